"""Cancellation: a client that goes away, streaming or not, and a request past its timeout are aborted at once,
and their KV blocks come back (checked through /metrics)."""
from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
from serve_helpers import wait_until

LONG = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 600, "ignore_eos": True}


def kv_used(server) -> float:
    return server.metric("tokenmill:kv_cache_used_tokens")


def idle(server) -> bool:
    return (kv_used(server) == 0 and server.metric("tokenmill:num_requests_running") == 0
            and server.metric("tokenmill:num_requests_waiting") == 0)


@pytest.fixture
def baseline(server):
    assert wait_until(lambda: idle(server)), "the server should start idle"
    return server.metric("tokenmill:request_abort_total", reason="client_disconnect")


def test_stream_disconnect_after_two_chunks_frees_blocks(server, baseline):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**LONG, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a closed iterator would close the connection
        events = 0
        while events < 2:
            events += next(lines).startswith("data: ")
        assert kv_used(server) > 0
        assert server.metric("tokenmill:num_requests_running") == 1
    closed = time.monotonic()
    assert wait_until(lambda: idle(server), timeout=5)
    assert time.monotonic() - closed < 5
    assert server.metric("tokenmill:request_abort_total", reason="client_disconnect") == baseline + 1


def test_non_streaming_disconnect_frees_blocks(server, baseline):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=httpx.Timeout(60, read=1.5))
    assert wait_until(lambda: idle(server), timeout=5)
    assert server.metric("tokenmill:request_abort_total", reason="client_disconnect") == baseline + 1


def test_non_streaming_disconnect_during_prefill_is_an_abort(server, baseline):
    """The client leaves while the prompt's prefill runs, in a step that also samples the only token asked for:
    the request is aborted, not counted as finished (the disconnect once went unheard until the request's first
    step was over, by which time this one had finished). A fresh prompt, so no prefix cache shortens the step."""
    success = server.metric("tokenmill:request_success_total")
    prompt = uuid.uuid4().hex + " hello" * 150
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                   timeout=httpx.Timeout(60, read=0.05))
    assert wait_until(lambda: idle(server))
    assert server.metric("tokenmill:request_abort_total", reason="client_disconnect") == baseline + 1
    assert server.metric("tokenmill:request_success_total") == success


def test_request_timeout(server, baseline):
    before = server.metric("tokenmill:request_abort_total", reason="timeout")
    r = httpx.post(server.url + "/v1/chat/completions", json={**LONG, "timeout_s": 0.5}, timeout=60)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "request_timeout"
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True, "stream": True,
                            "timeout_s": 0.5}, timeout=60) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert server.metric("tokenmill:request_abort_total", reason="timeout") == before + 2
    assert wait_until(lambda: idle(server), timeout=5)


def test_disconnect_right_after_the_headers(server, baseline):
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "hello " * 600, "max_tokens": 300, "ignore_eos": True, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
    assert wait_until(lambda: idle(server), timeout=5)
    assert server.metric("tokenmill:request_abort_total", reason="client_disconnect") == baseline + 1
