"""Routing through a real router over two real servers: a conversation sticks to its backend, new requests avoid a
busy backend, and long prompts go to the long pool. Which backend answered is read from x-tokenmill-backend."""
from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
from router_helpers import (
    affinity_backend,
    metric,
    openings_on,
    start_router,
    wait_until,
)

BACKEND_HEADER = "x-tokenmill-backend"


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def router(backends):
    r = start_router("--backend", backends[0].url, "--backend", backends[1].url)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(router):
    return client_for(router.url)


def ask(client: openai.OpenAI, model: str, messages: list[dict], stream: bool = False,
        max_tokens: int = 8) -> tuple[str, str]:
    """(the backend that answered, the answer)."""
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=max_tokens,
                                                           stream=stream)
    answer = raw.parse()
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    else:
        text = answer.choices[0].message.content
    return raw.headers[BACKEND_HEADER], text


def test_every_turn_of_a_conversation_lands_on_one_backend(client, model_name, backends):
    urls = [b.url for b in backends]
    for target in urls:
        system = "You are brief."
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": openings_on(urls, target, 1, "affinity", system)[0]}]
        for turn in range(3):
            backend, text = ask(client, model_name, messages, stream=turn == 1)
            assert backend == target
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then? ({turn})"}]


def test_conversations_spread_over_the_backends(router, client, model_name, backends):
    urls = [b.url for b in backends]
    before = {u: metric(router.url, "tokenmill:router_requests_total", backend=u, policy="affinity") for u in urls}
    openings = [f"spread #{i}: name a colour." for i in range(8)]
    seen = [ask(client, model_name, [{"role": "user", "content": o}], max_tokens=2)[0] for o in openings]
    assert seen == [affinity_backend(urls, o) for o in openings]
    for u in urls:
        assert metric(router.url, "tokenmill:router_requests_total", backend=u,
                      policy="affinity") - before[u] == seen.count(u)


def test_new_requests_avoid_a_busy_backend(router, client, model_name, backends):
    busy, idle = backends
    urls = [b.url for b in backends]
    # sent straight to `busy`, these are known to the router only through busy's own /metrics
    direct = client_for(busy.url)
    streams = [direct.completions.create(model=model_name, prompt=f"Story {i}: once upon a time", max_tokens=400,
                                         stream=True, extra_body={"ignore_eos": True}) for i in range(8)]
    try:
        for s in streams:
            next(iter(s))
        assert wait_until(lambda: metric(router.url, "tokenmill:router_backend_num_requests_running",
                                         backend=busy.url) >= 8)
        # conversations that would go to `busy` if the loads were even
        for opening in openings_on(urls, busy.url, 3, "least-load"):
            backend, _ = ask(client, model_name, [{"role": "user", "content": opening}], max_tokens=4)
            assert backend == idle.url
        assert metric(router.url, "tokenmill:router_requests_total", backend=idle.url, policy="least_load") >= 3
    finally:
        for s in streams:
            s.close()


def test_responses_are_routed_as_the_same_chat(router, client, model_name, backends):
    """A Responses request, streamed or not, goes where the chat of its instructions and input goes (while loads
    are even: an earlier test's streams may still weigh on a backend)."""
    urls = [b.url for b in backends]
    assert wait_until(lambda: all(metric(router.url, "tokenmill:router_backend_load", backend=u) < 1 for u in urls))
    for target in urls:
        opening = openings_on(urls, target, 1, "responses", "You are brief.")[0]
        for stream in (False, True):
            raw = client.responses.with_raw_response.create(model=model_name, instructions="You are brief.",
                                                            input=opening, max_output_tokens=2, stream=stream)
            answer = raw.parse()
            final = list(answer)[-1].response if stream else answer
            assert raw.headers[BACKEND_HEADER] == target and final.usage.output_tokens <= 2


@pytest.fixture(scope="module")
def pool_router(backends):
    r = start_router("--backend", backends[0].url, "--long-backend", backends[1].url, "--long-prompt-threshold", "64")
    yield r
    r.stop()


def test_long_prompts_go_to_the_long_pool(pool_router, model_name, backends):
    short, long = backends
    client = client_for(pool_router.url)
    long_text = "Summarize: " + " ".join(["The quick brown fox jumps over the lazy dog."] * 6)  # ~70 tokens estimated
    for i in range(2):
        assert ask(client, model_name, [{"role": "user", "content": f"Short question {i}?"}], max_tokens=2)[0] \
            == short.url
    assert ask(client, model_name, [{"role": "user", "content": long_text}], stream=True, max_tokens=2)[0] == long.url
    raw = client.completions.with_raw_response.create(model=model_name, prompt=long_text, max_tokens=2)
    assert raw.headers[BACKEND_HEADER] == long.url and raw.parse().choices[0].finish_reason
    raw = client.completions.with_raw_response.create(model=model_name, prompt="Short prompt", max_tokens=2)
    assert raw.headers[BACKEND_HEADER] == short.url
    assert metric(pool_router.url, "tokenmill:router_requests_total", pool="long") == 2
    assert metric(pool_router.url, "tokenmill:router_requests_total", pool="short") == 3


def test_router_endpoints(router, model_name):
    assert httpx.get(router.url + "/health").json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(router.url + "/v1/models").json()["data"]] == [model_name]
    assert httpx.post(router.url + "/tokenize", json={"prompt": "hello"}).json()["count"] > 0
    missing = httpx.get(router.url + "/nope")
    assert missing.status_code == 404 and "error" in missing.json()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_aborts_its_backend_request(router, model_name, backends, stream):
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": f"Disconnect ({stream})"}],
                       "max_tokens": 400, "ignore_eos": True, "stream": stream}).encode()
    aborted = sum(metric(b.url, "tokenmill:request_abort_total", reason="client_disconnect") for b in backends)
    with socket.create_connection(("127.0.0.1", router.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_until(lambda: metric(router.url, "tokenmill:router_in_flight") == 1 and
                          sum(metric(b.url, "tokenmill:num_requests_running") for b in backends) == 1)
    assert wait_until(lambda: sum(metric(b.url, "tokenmill:request_abort_total", reason="client_disconnect")
                                  for b in backends) == aborted + 1)
    assert wait_until(lambda: metric(router.url, "tokenmill:router_in_flight") == 0)


def test_a_body_over_the_limit_is_refused_by_the_router(backends, model_name):
    """The router reads a body whole before routing it, so it has its own limit: a larger body gets the server's
    413 without reaching a backend (it had none: any size was read into memory), and the router goes on."""
    r = start_router("--backend", backends[0].url, "--max-request-bytes", "2KiB")
    try:
        messages = [{"role": "user", "content": "x" * 4096}]
        big = httpx.post(r.url + "/v1/chat/completions", json={"model": model_name, "messages": messages})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        assert "2048 bytes" in big.json()["error"]["message"]
        assert ask(client_for(r.url), model_name, [{"role": "user", "content": "Hi"}])[0] == backends[0].url
    finally:
        r.stop()
