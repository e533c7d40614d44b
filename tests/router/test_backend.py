"""Backend.poll's verdicts from /health answers alone (httpx's mock transport, no server): a backend whose health
checks time out is dead unless its requests in flight are still receiving bytes or its /health answers come late,
in which case it only stops taking new requests; a slow /metrics (it waits for the engine's step) is no verdict
at all."""
from __future__ import annotations

import asyncio

import httpx

from tokenmill.router.backend import DOWN_AFTER_TIMEOUTS, Backend

METRICS = "# TYPE tokenmill:num_requests_running gauge\ntokenmill:num_requests_running 3.0\n"


def poll_with(backend: Backend, handler, polls: int = 1, interval: float = 0.0) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for i in range(polls):
                await asyncio.sleep(interval if i else 0.0)
                await backend.poll(client, timeout=0.5)
    asyncio.run(run())


def answers(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, text=METRICS if request.url.path == "/metrics" else "ok")


def hangs(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("timed out", request=request)


def test_healthy_backend_reports_its_load() -> None:
    backend = Backend("http://b", "default")
    poll_with(backend, answers)
    assert backend.healthy and not backend.dead.is_set() and backend.running == 3.0


def test_silent_backend_is_dead_after_the_timeouts() -> None:
    backend = Backend("http://b", "default")
    poll_with(backend, answers)
    poll_with(backend, hangs, DOWN_AFTER_TIMEOUTS - 1)
    assert backend.healthy and not backend.dead.is_set()  # one slow answer is not a verdict
    poll_with(backend, hangs)
    assert not backend.healthy and backend.dead.is_set()


def test_backend_whose_streams_progress_is_only_taken_out_of_rotation() -> None:
    backend = Backend("http://b", "default")
    poll_with(backend, answers)
    backend.progressed()
    poll_with(backend, hangs, DOWN_AFTER_TIMEOUTS)
    assert not backend.healthy and not backend.dead.is_set()  # its requests in flight go on
    poll_with(backend, answers)
    assert backend.healthy


def test_slow_metrics_keep_a_healthy_backend_and_its_last_load() -> None:
    """/metrics waits for the server's current engine step: its timeouts say nothing about liveness, so a backend
    serving a long non-streaming request (no bytes to show progress) is not declared dead by them."""
    backend = Backend("http://b", "default")
    poll_with(backend, answers)

    def slow_metrics(request: httpx.Request) -> httpx.Response:
        return answers(request) if request.url.path == "/health" else hangs(request)
    poll_with(backend, slow_metrics, 3 * DOWN_AFTER_TIMEOUTS)
    assert backend.healthy and not backend.dead.is_set() and backend.running == 3.0


def test_backend_whose_health_answers_come_late_is_only_taken_out_of_rotation() -> None:
    """A busy server (a CPU engine holding the interpreter) answers /health after the timeout: alive, though no
    stream shows it (its requests in flight may all be non-streaming), so they are not failed; whatever the poll
    interval (here twice the timeout, so the late answer is older than two timeouts at the verdict). Once the
    checks of a run stop answering at all, it is dead."""
    backend = Backend("http://b", "default")
    poll_with(backend, answers)
    calls = []

    async def late_then_silent(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        await asyncio.sleep(0.75 if len(calls) == 1 else 30.0)  # the first answers 0.25 s after its timeout
        return answers(request)
    poll_with(backend, late_then_silent, DOWN_AFTER_TIMEOUTS, interval=1.0)  # verdict at 2.0 s: 1.25 s later
    assert not backend.healthy and not backend.dead.is_set()
    poll_with(backend, answers)
    assert backend.healthy
    calls.clear()
    poll_with(backend, late_then_silent, DOWN_AFTER_TIMEOUTS + 1, interval=1.0)
    assert backend.dead.is_set()  # the run's later checks never answered
