"""AsyncEngine: drives the synchronous LLMEngine from one background asyncio task, for the server.

Every engine call (add, abort, step, stats) runs in one worker thread, one at a time: the event loop queues adds
and aborts, and the worker applies them just before the next step, so they never race step() and the event loop
stays responsive while the model runs. Each request gets a RequestStream of its outputs. A failing add fails that
request only; a failing step fails the requests in flight, and the loop goes on, except after a
TensorParallelError: the group is gone and every later step would fail, so the loop ends with the engine marked
failed (`failure`), refusing new requests; the server then reports itself unhealthy."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tokenmill.engine.llm_engine import LLMEngine, StepStats
from tokenmill.engine.tp_launcher import TensorParallelError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STOP_WAIT_S = 5.0  # how long stop() waits for a step still running


class RequestFailedError(RuntimeError):
    """The request was cut off: the engine failed while running it, or the server shut down."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its deadline (timeout_s) and was aborted."""


class EngineObserver(Protocol):
    """What the metrics are told, always on the event loop thread, between two engine iterations."""

    def on_step(self, step: StepStats) -> None: ...

    def on_output(self, output: RequestOutput) -> None: ...

    def on_abort(self, reason: str, request_id: str) -> None: ...

    def on_oom(self) -> None: ...


class RequestStream:
    """The outputs of one request, in order; raises RequestTimeoutError / RequestFailedError when it ends badly."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    timeout_s: float | None
    done: asyncio.Future[None]


@dataclass
class _Iteration:
    """What one worker-thread iteration hands back to the event loop."""

    add_errors: dict[str, Exception] = field(default_factory=dict)
    outputs: list[RequestOutput] = field(default_factory=list)
    step: StepStats | None = None
    step_error: Exception | None = None


def engine_thread() -> ThreadPoolExecutor:
    """The one thread an engine lives on. Build the engine there too (`engine_thread().submit(LLMEngine, args)`):
    torch's CPU thread pool belongs to the thread that first runs an op, and an engine loaded on the main thread
    but stepped on another drives two pools, which cost 15-25% of a 2-core CPU's decode throughput."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-engine")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observer: EngineObserver | None = None,
                 executor: ThreadPoolExecutor | None = None) -> None:
        """executor: the engine_thread() the engine was built on (a new one if None)."""
        self.engine = engine
        self.observer = observer
        self._streams: dict[str, RequestStream] = {}
        self._adds: list[_Add] = []
        self._taking: list[_Add] = []  # the adds of the iteration the worker is running
        self._aborts: list[str] = []
        self._executor = executor or engine_thread()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.failure: str | None = None  # why the engine can never step again, once it cannot

    # ---- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background loop on the running event loop."""
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="tokenmill-engine-loop")

    async def stop(self) -> None:
        """Stop the loop; whatever is still in flight fails and leaves the engine. A step cannot be interrupted
        (one long prefill can take minutes on a CPU), so a step still running after STOP_WAIT_S is not waited for:
        the engine thread is left to end it alone, and a shutdown does not last as long as the step."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        left = list(self._streams)
        self.abort_all("shutdown", RequestFailedError("the server shut down before the request finished"))
        leave = asyncio.get_running_loop().run_in_executor(self._executor, self.engine.abort_request, left)
        try:
            await asyncio.wait_for(leave, STOP_WAIT_S)
        except asyncio.TimeoutError:
            logger.warning("the engine thread is still in a step after %.1f s; not waiting for it", STOP_WAIT_S)
            self._executor.shutdown(wait=False, cancel_futures=True)
            return
        self._executor.shutdown(wait=True)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests ---------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, timeout_s: float | None = None) -> RequestStream:
        """Queue a request and wait until the engine took it; raises its ValueError / QueueFullError."""
        return (await self.add_requests([(request_id, prompt, params)], priority, timeout_s))[0]

    async def add_requests(self, requests: list[tuple[str, str | list[int], SamplingParams]], priority: int = 0,
                           timeout_s: float | None = None) -> list[RequestStream]:
        """Queue (request id, prompt, params) requests, all or none: the engine takes them in one iteration (a
        batch of prompts waits for one step, not one a prompt). If one is refused the others are aborted and its
        error raised."""
        if self.failure is not None:
            raise RequestFailedError(f"the engine failed and takes no more requests: {self.failure}")
        if not self.is_running:
            raise RequestFailedError("the engine loop is not running")
        ids = [rid for rid, _, _ in requests]
        seen: set[str] = set()
        for rid in ids:
            if rid in self._streams or rid in seen:
                raise ValueError(f"request id {rid!r} is already in use")
            seen.add(rid)
        loop = asyncio.get_running_loop()
        streams, adds = [], []
        for rid, prompt, params in requests:
            streams.append(RequestStream(rid))
            self._streams[rid] = streams[-1]
            adds.append(_Add(rid, prompt, params, priority, timeout_s, loop.create_future()))
        self._adds.extend(adds)
        self._kick()
        try:
            results = await asyncio.gather(*(a.done for a in adds), return_exceptions=True)
        except asyncio.CancelledError:
            for rid in ids:
                self.abort(rid, "client_disconnect")
            raise
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            for rid in ids:
                self.abort(rid, "error")
            raise error
        return streams

    def abort(self, request_id: str, reason: str, error: Exception | None = None) -> None:
        """Abort a request in flight; the engine frees its blocks before its next step. A request whose add
        the worker has not taken yet never reaches the engine; one whose add it is taking is aborted after that
        step. Either way its add raises `error` now: at shutdown the loop is cancelled and the step may never
        be dispatched, and its client would wait for nothing."""
        if self._streams.pop(request_id, None) is None:
            return
        pending = next((a for a in self._adds if a.request_id == request_id), None)
        if pending is None:
            self._aborts.append(request_id)
            pending = next((a for a in self._taking if a.request_id == request_id), None)
        else:
            self._adds.remove(pending)
        if pending is not None and not pending.done.done():
            pending.done.set_exception(error or RequestFailedError("the request was aborted before it started"))
        if self.observer is not None:
            self.observer.on_abort(reason, request_id)
        self._kick()

    def abort_all(self, reason: str, error: Exception) -> None:
        """Abort every request in flight, ending each stream with `error`."""
        for rid, stream in list(self._streams.items()):
            stream.queue.put_nowait(error)
            self.abort(rid, reason, error)

    async def get_stats(self) -> dict[str, Any]:
        """The engine's statistics, read between two steps, after the aborts asked for so far."""
        aborts, self._aborts = self._aborts, []
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._stats, aborts)

    def _stats(self, aborts: list[str]) -> dict[str, Any]:
        if aborts:
            self.engine.abort_request(aborts)
        return self.engine.get_stats()

    # ---- the loop ---------------------------------------------------------------------------
    def _kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _has_work(self) -> bool:
        return bool(self._adds or self._aborts or self.engine.has_unfinished_requests())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            in_flight = list(self._streams)
            self._taking = adds
            try:
                it = await loop.run_in_executor(self._executor, self._iterate, adds, aborts, in_flight)
                self._taking = []
                self._dispatch(adds, it)
            except Exception as e:  # a bug outside the engine step: fail what is in flight, keep serving
                self._taking = []
                logger.exception("engine loop iteration failed")
                for a in adds:
                    if not a.done.done():
                        a.done.set_exception(RequestFailedError(f"engine error: {e}"))
                self.abort_all("error", RequestFailedError(f"engine error: {e}"))
                continue
            if self.failure is not None:
                return  # every later step would fail the same way
            if it.step is not None and it.step.num_prefill_tokens + it.step.num_decode_tokens == 0:
                await asyncio.sleep(0.001)  # nothing could be scheduled: do not spin

    def _iterate(self, adds: list[_Add], aborts: list[str], in_flight: list[str]) -> _Iteration:
        """One iteration on the worker thread: adds, then aborts, then one step."""
        it = _Iteration()
        for a in adds:
            try:
                self.engine.add_request(a.request_id, a.prompt, a.params, priority=a.priority, timeout_s=a.timeout_s)
            except Exception as e:
                it.add_errors[a.request_id] = e
        if aborts:
            self.engine.abort_request(aborts)
        if not self.engine.has_unfinished_requests():
            return it
        try:
            it.outputs = self.engine.step()
            it.step = dataclasses.replace(self.engine.last_step)
        except Exception as e:
            logger.exception("engine step failed; failing the requests in flight")
            it.step_error = e
            self.engine.abort_request(in_flight)
        return it

    def _dispatch(self, adds: list[_Add], it: _Iteration) -> None:
        """Back on the event loop: settle the adds, then hand each output to its stream and the observer."""
        for a in adds:
            err = it.add_errors.get(a.request_id)
            if err is not None:
                self._streams.pop(a.request_id, None)
            if a.done.done():
                continue
            if err is None:
                a.done.set_result(None)
            else:
                a.done.set_exception(err)
        if it.step_error is not None:
            if self.observer is not None and isinstance(it.step_error, (torch.OutOfMemoryError, MemoryError)):
                self.observer.on_oom()
            if isinstance(it.step_error, TensorParallelError):
                self.failure = str(it.step_error)
                logger.error("the engine cannot run again: its loop ends and /health reports 503 until the server "
                             "is restarted")
            self.abort_all("error", RequestFailedError(f"the engine failed while running this request: "
                                                       f"{type(it.step_error).__name__}: {it.step_error}"))
        for out in it.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted while this step ran: the observer has been told
                continue
            if self.observer is not None:
                self.observer.on_output(out)
            item: RequestOutput | BaseException = out
            if out.finished and any(c.finish_reason == "abort" for c in out.outputs):
                timed_out = any(c.stop_reason == "timeout" for c in out.outputs)
                item = RequestTimeoutError("the request exceeded its timeout") if timed_out else \
                    RequestFailedError(out.error or "the request was aborted")
                if self.observer is not None:
                    self.observer.on_abort("timeout" if timed_out else "error", out.request_id)
            stream.queue.put_nowait(item)
            if out.finished:
                del self._streams[out.request_id]
        if it.step is not None and self.observer is not None:
            self.observer.on_step(it.step)
