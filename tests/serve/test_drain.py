"""SIGTERM drains: new requests get 503, requests in flight finish (or are aborted when the grace period is over),
and the process exits with status 0."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from serve_helpers import Server

CHAT = "/v1/chat/completions"


def stream_events(url: str, body: dict, started: threading.Event, events: list[str]) -> None:
    with httpx.stream("POST", url + CHAT, json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def test_sigterm_drains_in_flight_requests():
    server = Server("--max-model-len", "1024", "--shutdown-timeout", "60")
    try:
        events: list[str] = []
        started = threading.Event()
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        t = threading.Thread(target=stream_events, args=(server.url, body, started, events))
        t.start()
        assert started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        r = httpx.post(server.url + CHAT, json={"messages": [{"role": "user", "content": "x"}]}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert httpx.get(server.url + "/health", timeout=30).status_code == 503
        assert httpx.head(server.url + "/health", timeout=30).status_code == 503
        t.join(120)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 24
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def test_grace_period_over_aborts_the_rest():
    server = Server("--max-model-len", "1024", "--shutdown-timeout", "1")
    try:
        events: list[str] = []
        started = threading.Event()
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 900, "ignore_eos": True}
        t = threading.Thread(target=stream_events, args=(server.url, body, started, events))
        t.start()
        assert started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "shutdown"
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def test_grace_period_over_exits_during_a_long_step():
    """The engine thread cannot be interrupted in a step: one prefill of a long prompt (minutes on a CPU) must not
    keep the process alive past the grace period, nor need a second signal; its client gets the 503 at once."""
    n = 5000
    server = Server("--max-model-len", str(n + 8), "--max-num-batched-tokens", str(n + 8), "--shutdown-timeout", "1")
    try:
        responses: list[httpx.Response] = []
        body = {"prompt": [1] * n, "max_tokens": 1}
        t = threading.Thread(target=lambda: responses.append(
            httpx.post(server.url + "/v1/completions", json=body, timeout=120)))
        t.start()
        time.sleep(2)  # the request's prefill is now the step in progress
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        t.join(30)
        assert responses and responses[0].status_code == 503, responses  # not left to time out into a 500
        assert responses[0].json()["error"]["code"] == "shutdown"
        assert "draining: 1 requests in flight" in server.output()
    finally:
        server.stop()
