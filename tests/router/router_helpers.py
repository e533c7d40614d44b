"""Real processes for the router tests: `python -m tokenmill.cli serve|router` on free ports of 127.0.0.1, their
metrics, and conversations chosen to hash to a given backend (so no test depends on which ports it got)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from tokenmill.router.backend import Backend
from tokenmill.router.policy import choose, route_info

STARTUP_TIMEOUT_S = 180
# A small context; the tests' prompts and outputs are short.
SERVER_ARGS = ("--max-model-len", "512")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """`tokenmill <command> --port P ...`, started at once; wait_ready() blocks until /health says 200."""

    def __init__(self, command: str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"tokenmill-{command}-", suffix=".log",  # noqa: SIM115
                                               delete=False)  # the process writes it until stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", command, "--port", str(self.port), "--no-access-log", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self) -> Proc:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.url} not ready after {STARTUP_TIMEOUT_S} s:\n{self.output()}")

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


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


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` at url/metrics whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        base, _, rest = key.partition("{")
        found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if base == name and all(found.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


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
