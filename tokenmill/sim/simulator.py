"""The event loop: the engine's own Scheduler and KVCacheManager, driven on a virtual clock.

Each iteration does what LLMEngine.step does, minus the model: admit the requests that have arrived by now,
schedule(), advance the clock by the cost model's time for the scheduled batch, update_from_output with an
arbitrary token per sampling request, and finish requests through the engine's own stop check (max_tokens,
max_model_len). When nothing can run, the clock jumps to the next arrival."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.scheduler import QueueFullError, Scheduler
from tokenmill.engine.detokenizer import check_stop
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.sim.cost_model import CostModel, step_shape
from tokenmill.sim.workload import SimRequest

SAMPLED_TOKEN = 0   # the simulator's every generated token; only counts matter (workloads ignore EOS)


@dataclass
class Sample:
    """The engine's state right after a step was scheduled."""

    time: float
    used_blocks: int
    running: int
    waiting: int


@dataclass
class SimResult:
    requests: list[Request]                   # every admitted request, finished or timed out
    classes: dict[str, str]                   # request id -> class name
    rejected: list[tuple[SimRequest, str]]    # refused at admission, with the reason
    timeline: list[Sample] = field(default_factory=list)
    usable_blocks: int = 0
    block_size: int = 16
    start: float = 0.0
    end: float = 0.0
    num_steps: int = 0
    num_preemptions: int = 0

    @property
    def duration(self) -> float:
        return max(self.end - self.start, 1e-9)


class Simulator:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, cost: CostModel,
                 enable_prefix_caching: bool = True, timeout_s: float | None = None) -> None:
        self.kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache)
        self.now = 0.0
        self.scheduler.clock = lambda: self.now
        self.cost = cost
        self.timeout_s = timeout_s

    def _add(self, r: SimRequest, result: SimResult) -> None:
        req = Request(r.request_id, r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                      arrival_time=r.arrival_time, priority=r.priority, timeout_s=self.timeout_s)
        try:
            self.scheduler.add_request(req)
        except (ValueError, QueueFullError) as e:
            result.rejected.append((r, str(e)))
            return
        result.requests.append(req)
        result.classes[req.request_id] = r.cls

    def run(self, workload: list[SimRequest], check_invariants: bool = False) -> SimResult:
        """Simulate the workload to completion; check_invariants verifies the block pool after every step."""
        pending = sorted(workload, key=lambda r: r.arrival_time)
        sched, kv = self.scheduler, self.kv_cache
        result = SimResult([], {}, [], usable_blocks=kv.usable_blocks, block_size=kv.block_size)
        self.now = result.start = pending[0].arrival_time if pending else 0.0
        i = 0
        while i < len(pending) or sched.num_unfinished:
            while i < len(pending) and pending[i].arrival_time <= self.now:
                self._add(pending[i], result)
                i += 1
            out = sched.schedule()
            if out.is_empty:
                if out.preempted or out.timed_out:
                    continue
                if i < len(pending):
                    self.now = pending[i].arrival_time
                    continue
                if not sched.num_unfinished:
                    break
                raise RuntimeError(f"the scheduler made no progress with {sched.num_unfinished} requests left")
            result.timeline.append(Sample(self.now, kv.usable_blocks - kv.num_free_blocks, len(sched.running),
                                          len(sched.waiting)))
            self.now += self.cost.step_time(step_shape(out))
            sampled = [s.request for s in out.scheduled if s.samples]
            sched.update_from_output(out, {r.request_id: SAMPLED_TOKEN for r in sampled})
            for req in sampled:
                self._record_token(req)
            result.num_steps += 1
            if check_invariants:
                kv.check_invariants()
        result.end = self.now
        result.num_preemptions = sched.stats.num_preemptions
        return result

    def _record_token(self, req: Request) -> None:
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = self.now
        m.last_token_time = self.now
        m.num_generated += 1
        stop = check_stop(req, [], self.scheduler.config.max_model_len)
        if stop is not None:
            self.scheduler.finish_request(req, *stop)
            m.finished_time = self.now
