"""SIGTERM drains: new requests get 503, requests in flight finish (or are aborted when the grace period is over),
and the process exits with status 0."""
from __future__ import annotations

import json
import signal
import threading

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
