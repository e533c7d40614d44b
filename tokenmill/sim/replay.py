"""The ground truth: drive a real LLMEngine through a workload in wall-clock time, recording what the simulator
would record (request metrics, KV usage) plus the shape and duration of every step, which `--fit` regresses on."""
from __future__ import annotations

import time
from typing import Self

from tokenmill.core.scheduler import SchedulerOutput
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams
from tokenmill.sim.cost_model import StepShape, step_shape
from tokenmill.sim.simulator import Sample, SimResult
from tokenmill.sim.workload import SimRequest


class StepTrace:
    """While in a with-block, wraps the engine's scheduler.schedule to catch each step's shape, which exists only
    between schedule() and update_from_output(), and the pool's state at that moment."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.shapes: list[StepShape] = []
        self.timeline: list[Sample] = []

    def __enter__(self) -> Self:
        self._schedule = self.engine.scheduler.schedule
        self.engine.scheduler.schedule = self._traced_schedule
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.scheduler.schedule   # back to the class's method

    def _traced_schedule(self) -> SchedulerOutput:
        out = self._schedule()
        if not out.is_empty:
            kv, sched = self.engine.kv_cache, self.engine.scheduler
            self.shapes.append(step_shape(out))
            self.timeline.append(Sample(time.monotonic(), kv.usable_blocks - kv.num_free_blocks, len(sched.running),
                                        len(sched.waiting)))
        return out

    def step(self) -> tuple[StepShape, float] | None:
        """One engine.step(); its shape and wall time, or None when nothing was scheduled."""
        n = len(self.shapes)
        t0 = time.perf_counter()
        self.engine.step()
        return (self.shapes[-1], time.perf_counter() - t0) if len(self.shapes) > n else None


def add(engine: LLMEngine, r: SimRequest, arrival_time: float | None = None) -> None:
    """A workload's classes keep their priorities under either policy (to compare the two), and the engine takes
    a priority only under "priority" (as vLLM), where FCFS ignores it anyway."""
    priority = r.priority if engine.scheduler.config.policy == "priority" else 0
    engine.add_request(r.request_id, r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                       priority=priority, arrival_time=arrival_time)


def replay(engine: LLMEngine, workload: list[SimRequest]) -> tuple[SimResult, list[tuple[StepShape, float]]]:
    """Send each request when its arrival time comes (relative to now) and step the engine until all finish.
    Returns the run and, per non-empty step, (shape, seconds of the whole engine.step())."""
    kv, sched = engine.kv_cache, engine.scheduler
    result = SimResult([], {}, [], usable_blocks=kv.usable_blocks, block_size=kv.block_size)
    steps: list[tuple[StepShape, float]] = []
    pending = sorted(workload, key=lambda r: r.arrival_time)
    preemptions_before = sched.stats.num_preemptions
    with StepTrace(engine) as trace:
        start = result.start = time.monotonic()
        i = 0
        while i < len(pending) or engine.has_unfinished_requests():
            now = time.monotonic()
            while i < len(pending) and start + pending[i].arrival_time <= now:
                r = pending[i]
                add(engine, r, start + r.arrival_time)
                result.requests.append(engine.groups[r.request_id].children[0])
                result.classes[r.request_id] = r.cls
                i += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, start + pending[i].arrival_time - now))
                continue
            if (sample := trace.step()) is not None:
                steps.append(sample)
    result.end = time.monotonic()
    result.timeline = trace.timeline
    result.num_steps = len(steps)
    result.num_preemptions = sched.stats.num_preemptions - preemptions_before
    return result, steps
