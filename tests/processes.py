"""Real tokenmill processes for the tests (`python -m tokenmill.cli serve|router` on a free port of 127.0.0.1),
their Prometheus metrics, and polling; shared by the server and router tests."""
from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx

STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """`tokenmill <command> --port P ...`, started at once; wait_ready() blocks until /health says 200."""

    def __init__(self, command: str, *args: str, tls: ssl.SSLContext | None = None) -> None:
        """tls: the process serves HTTPS (its certificate flags among args), trusted through this context."""
        self.port = free_port()
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
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
                if httpx.get(self.url + "/health", timeout=2, verify=self.tls or True).status_code == 200:
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

    def metrics(self) -> dict[str, float]:
        return samples(self.url)

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.url, name, **labels)

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


def samples(url: str) -> dict[str, float]:
    """Prometheus samples at url/metrics by name with labels, e.g. 'tokenmill:request_abort_total{...}'."""
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return {key: float(value) for key, value in (line.rsplit(" ", 1) for line in lines
                                                  if line and not line.startswith("#"))}


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` at url/metrics whose labels include `labels`, e.g.
    metric(url, 'tokenmill:request_abort_total', reason='timeout')."""
    total = 0.0
    for key, value in samples(url).items():
        base, _, rest = key.partition("{")
        found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if base == name and all(found.get(k) == v for k, v in labels.items()):
            total += value
    return total


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
