"""Scheduling policy behaviour: long-prompt floods, priorities, aging, deadlines."""
import time

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.scheduler import Scheduler
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


def make(num_blocks=200, block_size=16, **kw):
    kv = KVCacheManager(num_blocks, block_size)
    cfg = dict(max_num_batched_tokens=256, max_num_seqs=64, max_model_len=4096)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg), kv), kv


def step(sch, max_tokens=None):
    out = sch.schedule()
    sch.update_from_output(out, {s.request.request_id: 5 for s in out.scheduled if s.samples})
    for s in out.scheduled:
        r = s.request
        if r.num_output_tokens and r.num_output_tokens >= r.sampling_params.max_tokens:
            sch.finish_request(r, RequestStatus.FINISHED_LENGTH)
    return out


def test_decodes_keep_flowing_during_long_prompt_flood():
    sch, kv = make(num_blocks=1000, long_prefill_token_threshold=128, max_long_partial_prefills=1)
    shorts = [Request(f"s{i}", [1] * 20, SamplingParams(max_tokens=60)) for i in range(8)]
    for r in shorts:
        sch.add_request(r)
    step(sch)
    for i in range(6):
        sch.add_request(Request(f"long{i}", [100 + i] * 1500, SamplingParams(max_tokens=4)))
    for _ in range(40):
        before = {r.request_id: r.num_output_tokens for r in shorts if not r.is_finished}
        out = step(sch)
        long_chunks = [s for s in out.scheduled if s.request.request_id.startswith("long")]
        remaining_before = [s.request.num_prompt_tokens - (s.request.num_computed_tokens - s.num_new_tokens)
                            for s in long_chunks]
        assert sum(1 for n in remaining_before if n > 128) <= 1
        assert all(s.num_new_tokens <= 128 for s in long_chunks)
        for r in shorts:
            if r.request_id in before:
                assert r.num_output_tokens == before[r.request_id] + 1, "a short request stalled"
        kv.check_invariants()


def test_an_urgent_prefill_leaves_running_decodes_their_token():
    """Under priority the urgent request is served first, but its prefill chunk takes the budget less a token
    for each decode after it: the less urgent request decodes in every step of the long prefill."""
    sch, kv = make(num_blocks=1000, policy="priority")
    low = Request("low", [1] * 20, SamplingParams(max_tokens=100), priority=1)
    sch.add_request(low)
    step(sch)
    sch.add_request(Request("urgent", [7] * 2000, SamplingParams(max_tokens=4), priority=0))
    for chunk in [255] * 7 + [2000 - 7 * 255]:
        out = step(sch)
        assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == {"low": 1, "urgent": chunk}


def test_urgent_request_preempts_less_urgent_under_priority_policy():
    sch, kv = make(num_blocks=9, block_size=16, policy="priority", max_num_batched_tokens=512)
    low = [Request(f"low{i}", [1] * 60, SamplingParams(max_tokens=50), priority=5) for i in range(2)]
    for r in low:
        sch.add_request(r)
    step(sch)
    urgent = Request("urgent", [3] * 60, SamplingParams(max_tokens=5), priority=0)
    sch.add_request(urgent)
    out = step(sch)
    assert any(r.priority == 5 for r in out.preempted)
    assert urgent.status == RequestStatus.RUNNING
    kv.check_invariants()


def test_fcfs_does_not_preempt_for_waiting_requests():
    sch, kv = make(num_blocks=9, block_size=16, policy="fcfs", max_num_batched_tokens=512)
    for i in range(2):
        sch.add_request(Request(f"low{i}", [1] * 60, SamplingParams(max_tokens=50), priority=5))
    step(sch)
    urgent = Request("urgent", [3] * 60, SamplingParams(max_tokens=5), priority=0)
    sch.add_request(urgent)
    out = step(sch)
    assert not out.preempted and urgent.status == RequestStatus.WAITING


def test_aging_lets_old_low_priority_requests_in():
    sch, kv = make(policy="priority", max_num_seqs=1, priority_aging_s=0.05)
    old = Request("old", [1] * 10, SamplingParams(max_tokens=2), priority=3, arrival_time=time.monotonic() - 1.0)
    new = Request("new", [1] * 10, SamplingParams(max_tokens=2), priority=0)
    sch.add_request(new)
    sch.add_request(old)
    out = sch.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["old"]


def test_an_aged_running_request_is_not_preempted_for_a_less_urgent_newcomer():
    """Preemption ranks by the same aged priority as admission: a low-priority request that has waited long
    enough to outrank a fresh urgent one keeps running (before, it was preempted, admitted again in the same
    step ahead of the newcomer, and preempted again on every step while the newcomer never ran)."""
    sch, kv = make(policy="priority", max_num_seqs=1, priority_aging_s=0.01)
    old = Request("old", [1] * 10, SamplingParams(max_tokens=50), priority=5, arrival_time=time.monotonic() - 1.0)
    sch.add_request(old)
    step(sch)
    new = Request("new", [2] * 10, SamplingParams(max_tokens=2), priority=0)
    sch.add_request(new)
    for _ in range(5):
        out = step(sch)
        assert out.preempted == [] and [s.request.request_id for s in out.scheduled] == ["old"]
    assert sch.stats.num_preemptions == 0 and new.status == RequestStatus.WAITING


def test_when_blocks_run_short_the_less_urgent_running_request_yields():
    """Under priority, running requests are served most urgent first, so the urgent one never loses its blocks
    to a less urgent one admitted earlier (before: the urgent one was preempted, then preempted the other
    on the next step and recomputed its prompt)."""
    sch, kv = make(num_blocks=8, block_size=4, policy="priority", max_num_batched_tokens=64, max_model_len=64)
    low = Request("low", [1] * 10, SamplingParams(max_tokens=15), priority=2)
    sch.add_request(low)
    step(sch)
    high = Request("high", [2] * 10, SamplingParams(max_tokens=15), priority=0)
    sch.add_request(high)
    preempted = [r.request_id for _ in range(8) for r in step(sch).preempted]
    assert preempted == ["low"] and high.num_preemptions == 0 and high.num_output_tokens == 8


def test_deadline_aborts_and_frees_blocks():
    sch, kv = make()
    r = Request("slow", [1] * 40, SamplingParams(max_tokens=1000), timeout_s=0.05)
    sch.add_request(r)
    step(sch)
    assert kv.num_free_blocks < kv.usable_blocks
    time.sleep(0.06)
    out = step(sch)
    assert out.timed_out == [r] and r.status == RequestStatus.FINISHED_ABORTED and r.stop_reason == "timeout"
    assert kv.num_free_blocks == kv.usable_blocks and sch.stats.num_timeouts == 1


def test_lru_keeps_freed_prefix_blocks_until_needed():
    sch, kv = make(num_blocks=10, block_size=4)
    a = Request("a", list(range(17)), SamplingParams(max_tokens=1))
    sch.add_request(a)
    step(sch)
    assert a.is_finished and kv.pool.num_cached_free_blocks == 4
    b = Request("b", list(range(17)), SamplingParams(max_tokens=1))
    sch.add_request(b)
    step(sch)
    assert b.num_cached_tokens == 16
    c = Request("c", [99] * 33, SamplingParams(max_tokens=1))  # needs every block: evicts the cache
    sch.add_request(c)
    step(sch)
    assert c.is_finished and kv.num_free_blocks == kv.usable_blocks
    kv.check_invariants()
