"""Real processes for the router tests: `python -m tokenmill.cli serve|router` on free ports of 127.0.0.1, their
metrics, and conversations chosen to hash to a given backend (so no test depends on which ports it got)."""
from __future__ import annotations

import json

from processes import Proc, metric, wait_until
from tokenmill.router.backend import Backend
from tokenmill.router.policy import choose, route_info

__all__ = ["Proc", "metric", "wait_until", "start_servers", "start_router", "affinity_backend", "openings_on"]

# A small context; the tests' prompts and outputs are short.
SERVER_ARGS = ("--max-model-len", "512")


def start_servers(n: int) -> list[Proc]:
    """n model servers, loading side by side."""
    servers = [Proc("serve", *SERVER_ARGS) for _ in range(n)]
    try:
        return [s.wait_ready() for s in servers]
    except Exception:
        for s in servers:
            s.stop()
        raise


def start_router(*args: str) -> Proc:
    return Proc("router", "--log-level", "warning", *args).wait_ready()


def affinity_backend(backend_urls: list[str], first_message: str, system: str | None = None) -> str:
    """The backend the router gives a conversation opening with this user message while loads are even."""
    opening = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": first_message}]
    key = route_info("/v1/chat/completions", json.dumps({"messages": opening}).encode()).key
    return choose([Backend(u, "short") for u in backend_urls], key, slack=0.0).backend.url


def openings_on(backend_urls: list[str], target: str, n: int, topic: str, system: str | None = None) -> list[str]:
    """n distinct first user messages whose conversations the router gives to `target`."""
    found: list[str] = []
    i = 0
    while len(found) < n:
        text = f"{topic} #{i}: say something short."
        if affinity_backend(backend_urls, text, system) == target:
            found.append(text)
        i += 1
    return found
