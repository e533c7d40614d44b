"""The web UI in a real headless browser (Debian's chromium driven by Playwright): a prompt typed into the chat
streams an answer onto the page, and the dashboard fills from the server's own statistics."""
from __future__ import annotations

import os

import pytest

CHROMIUM = "/usr/bin/chromium"
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs `pip install playwright`")
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"the browser test needs {CHROMIUM}")


@pytest.fixture(scope="module")
def page(server):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(server.url + "/")
        yield page
        browser.close()


def test_chat_streams_an_answer(page):
    page.fill("#max_tokens", "24")
    page.check("#ignore_eos")
    page.fill("#prompt", "Write one sentence about the sea.")
    seen: list[str] = []
    page.expose_function("record", lambda text: seen.append(text))
    page.evaluate("""() => new MutationObserver(() => {
        const bubbles = document.querySelectorAll('.msg.assistant');
        if (bubbles.length) window.record(bubbles[bubbles.length - 1].textContent);
    }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true})""")
    page.click("#send")
    sync_api.expect(page.locator(".msg.user")).to_have_text("Write one sentence about the sea.")
    sync_api.expect(page.locator("#status")).to_contain_text("24 tokens", timeout=60_000)
    answer = page.locator(".msg.assistant").last.text_content()
    assert answer
    partial = [s for s in seen if s and s != answer]
    assert partial, "the answer should appear piece by piece, not all at once"
    assert all(answer.startswith(s) for s in partial)
    assert page.locator(".msg.error").count() == 0


def test_dashboard_shows_live_stats(page):
    page.click("#tab-dashboard")
    sync_api.expect(page.locator("#dashboard-panel")).to_be_visible()
    sync_api.expect(page.locator("#t-kv")).to_contain_text("%", timeout=10_000)
    sync_api.expect(page.locator("#t-running")).to_have_text("0", timeout=10_000)
    assert page.locator("#t-rate").text_content() != "-"
