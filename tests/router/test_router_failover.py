"""A backend failing under load, through a real router: a hung backend is taken out by the health check and its
requests in flight fail with the retryable `backend_unavailable` error, then it comes back; a killed backend fails
only its own requests, the other backend's all complete, and later requests succeed."""
from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from router_helpers import metric, openings_on, start_router, start_servers, wait_until

BACKEND_HEADER = "x-tokenmill-backend"
LONG = {"max_tokens": 400, "extra_body": {"ignore_eos": True}}  # still running when the backend fails


@pytest.fixture(scope="module")
def victim():
    [server] = start_servers(1)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def router(backends, victim):
    r = start_router("--backend", backends[0].url, "--backend", victim.url, "--health-timeout", "1.5",
                     "--poll-interval", "0.3")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chat(client: openai.OpenAI, model: str, text: str, stream: bool, **kw) -> str:
    """The backend that answered; raises the client's error if the request failed, whenever it failed."""
    raw = client.chat.completions.with_raw_response.create(model=model, messages=user(text), stream=stream, **kw)
    answer = raw.parse()
    if stream:
        assert any(c.choices and c.choices[0].finish_reason for c in answer)
    else:
        assert answer.choices[0].finish_reason
    return raw.headers[BACKEND_HEADER]


def assert_retryable(e: openai.APIError) -> None:
    assert e.code == "backend_unavailable"
    if isinstance(e, openai.APIStatusError):
        assert e.status_code == 503 and e.response.headers["retry-after"] == "1"


def backend_up(router, url: str) -> bool:
    return metric(router.url, "tokenmill:router_backend_up", backend=url) == 1


def failures(router, url: str, *reasons: str) -> float:
    """Requests failed under the backend (lost mid-request or failed by the health check)."""
    return sum(metric(router.url, "tokenmill:router_request_failures_total", backend=url, reason=r)
               for r in reasons or ("lost", "down"))


def test_a_hung_backend_is_taken_out_then_comes_back(router, client, model_name, backends, victim):
    survivor = backends[0]
    urls = [survivor.url, victim.url]
    on_victim = openings_on(urls, victim.url, 3, "hung")
    failed_before = failures(router, victim.url, "down")
    raw = client.chat.completions.with_raw_response.create(model=model_name, messages=user(on_victim[0]),
                                                           stream=True, **LONG)
    assert raw.headers[BACKEND_HEADER] == victim.url
    events = iter(raw.parse())
    next(events)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(chat, client, model_name, on_victim[1], False, **LONG)
        assert wait_until(lambda: metric(router.url, "tokenmill:router_in_flight", backend=victim.url) == 2)
        victim.signal(signal.SIGSTOP)
        try:
            with pytest.raises(openai.APIError) as streamed:
                for _ in events:
                    pass
            assert_retryable(streamed.value)
            with pytest.raises(openai.APIStatusError) as answered:
                waiting.result(timeout=30)
            assert_retryable(answered.value)
            assert answered.value.response.headers[BACKEND_HEADER] == victim.url
            assert not backend_up(router, victim.url)
            assert failures(router, victim.url, "down") - failed_before == 2
            # the conversation's backend is down: it goes to the other one
            assert chat(client, model_name, on_victim[2], False, max_tokens=2) == survivor.url
        finally:
            victim.signal(signal.SIGCONT)
    assert wait_until(lambda: backend_up(router, victim.url))
    assert chat(client, model_name, on_victim[2], False, max_tokens=2) == victim.url


def test_killing_a_backend_fails_only_its_own_requests(router, client, model_name, backends, victim):
    survivor = backends[0]
    urls = [survivor.url, victim.url]
    # three conversations each: within the affinity slack, so each stays on its backend
    doomed, kept = openings_on(urls, victim.url, 3, "kill"), openings_on(urls, survivor.url, 3, "kill")
    failed_before = failures(router, victim.url)
    with ThreadPoolExecutor(6) as pool:
        survivors = [pool.submit(chat, client, model_name, t, i % 2 == 0, max_tokens=32,
                                 extra_body={"ignore_eos": True}) for i, t in enumerate(kept)]
        victims = [pool.submit(chat, client, model_name, t, i % 2 == 0, **LONG) for i, t in enumerate(doomed)]
        assert wait_until(lambda: metric(router.url, "tokenmill:router_in_flight", backend=victim.url) == 3
                          and metric(victim.url, "tokenmill:num_requests_running") >= 3)
        victim.proc.kill()
        for f in victims:
            with pytest.raises(openai.APIError) as failed:
                f.result(timeout=60)
            assert_retryable(failed.value)
        assert [f.result(timeout=120) for f in survivors] == [survivor.url] * 3
    assert failures(router, victim.url) - failed_before == 3
    # later requests succeed, the dead backend's conversations included, whether or not a poll has noticed yet
    for text in doomed + kept:
        assert chat(client, model_name, text, False, max_tokens=2) == survivor.url
    assert not backend_up(router, victim.url)
