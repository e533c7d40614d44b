"""Drive the real scheduler and KV cache manager with hundreds of random requests (no model) and check
block accounting after every step."""
import random

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.scheduler import QueueFullError, Scheduler
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, caching=True, **kw):
    kv = KVCacheManager(num_blocks, block_size, caching)
    cfg = dict(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=200)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg), kv), kv


def policy_key(sch, req):
    """The order a policy admits in (aging is 10 s; a run takes well under a second, so it never applies)."""
    return req.arrival_time if sch.config.policy == "fcfs" else (req.priority, req.arrival_time)


def run_random(seed, caching, policy="fcfs", steps_limit=20000):
    """Returns the scheduler, the cache manager and counts of what the run went through."""
    rng = random.Random(seed)
    threshold = rng.choice([0, 24])
    max_num_seqs = rng.choice([4, 8])
    sch, kv = make_scheduler(caching=caching, policy=policy, long_prefill_token_threshold=threshold,
                             max_num_seqs=max_num_seqs)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
    added, n_req = 0, 300
    finished = set()
    seen = {"peak_running": 0, "preempt_and_admit_steps": 0}
    steps = 0
    while added < n_req or sch.num_unfinished:
        for _ in range(rng.randrange(0, 4)):
            if added < n_req:
                prompt = rng.choice(prefixes)[:] if rng.random() < 0.5 else []
                prompt += [rng.randrange(50) for _ in range(rng.randrange(1, 60))]
                params = SamplingParams(max_tokens=rng.randrange(1, 40))
                timeout = rng.uniform(0.0005, 0.01) if rng.random() < 0.05 else None
                req = Request(f"r{added}", prompt, params, priority=rng.randrange(3), timeout_s=timeout)
                sch.add_request(req)
                added += 1
        was_running = {r.request_id for r in sch.running}
        out = sch.schedule()
        kv.check_invariants()
        assert len(sch.running) <= max_num_seqs
        seen["peak_running"] = max(seen["peak_running"], len(sch.running))
        finished.update(r.request_id for r in out.timed_out)
        for s in out.scheduled:
            assert s.num_new_tokens >= 1
            assert len(kv.req_to_blocks[s.request.request_id]) * kv.block_size >= \
                s.request.num_computed_tokens + s.num_new_tokens
        assert out.num_prefill_tokens + out.num_decode_tokens <= 64
        # admission takes the head of the policy's order: no request left waiting goes before one admitted,
        # unless it is a long prompt held back by the long-prefill cap
        preempted = {r.request_id for r in out.preempted}
        admitted = [s.request for s in out.scheduled
                    if s.request.request_id not in was_running or s.request.request_id in preempted]
        for a in admitted:
            for w in sch.waiting:
                if not threshold or w.num_tokens <= threshold:
                    assert policy_key(sch, w) >= policy_key(sch, a), (a, w)
        if out.preempted and admitted:
            seen["preempt_and_admit_steps"] += 1
        sampled = {s.request.request_id: rng.randrange(50) for s in out.scheduled if s.samples}
        sch.update_from_output(out, sampled)
        for s in out.scheduled:
            r = s.request
            if r.request_id in sampled and r.num_output_tokens >= r.sampling_params.max_tokens:
                sch.finish_request(r, RequestStatus.FINISHED_LENGTH)
                finished.add(r.request_id)
        if rng.random() < 0.05 and sch.requests:
            rid = rng.choice(sorted(sch.requests))
            sch.abort_request(rid)
            finished.add(rid)
        kv.check_invariants()
        assert len(sch.running) <= max_num_seqs
        steps += 1
        assert steps < steps_limit, "scheduler stalled"
    assert len(finished) == n_req
    assert sch.stats.num_timeouts > 0
    assert kv.num_free_blocks == kv.usable_blocks
    assert not kv.req_to_blocks
    assert seen["peak_running"] == max_num_seqs, "the workload never reached max_num_seqs: the cap went untested"
    return sch, kv, seen


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("caching", [True, False])
def test_random_workload_accounts_every_block(seed, caching):
    _, kv, seen = run_random(seed, caching)
    if caching:
        assert kv.prefix_hits > 0
    # fcfs only preempts when running requests run out of blocks, and then admits nobody that step
    assert seen["preempt_and_admit_steps"] == 0


def test_priority_policy_random():
    """The workload is under memory pressure (preemptions happen and every request still ends), and urgent
    waiting requests really preempt less urgent running ones and are admitted in their place."""
    sch, _, seen = run_random(7, True, policy="priority")
    assert sch.stats.num_preemptions > 0
    assert not sch.requests and sch.num_unfinished == 0
    assert seen["preempt_and_admit_steps"] > 0


def test_preemption_when_blocks_run_out():
    sch, kv = make_scheduler(num_blocks=9, block_size=4, caching=False)
    reqs = [Request(f"r{i}", list(range(10)), SamplingParams(max_tokens=20)) for i in range(3)]
    for r in reqs:
        sch.add_request(r)
    preempted = 0
    for _ in range(200):
        out = sch.schedule()
        kv.check_invariants()
        preempted += len(out.preempted)
        sch.update_from_output(out, {s.request.request_id: 1 for s in out.scheduled if s.samples})
        for s in out.scheduled:
            if s.request.num_output_tokens >= 20:
                sch.finish_request(s.request, RequestStatus.FINISHED_LENGTH)
        if not sch.num_unfinished:
            break
    assert preempted > 0 and sch.stats.num_preemptions == preempted
    assert all(r.num_output_tokens == 20 for r in reqs)
    assert kv.num_free_blocks == kv.usable_blocks


def test_prefix_hit_reuses_blocks_and_checks_tokens():
    sch, kv = make_scheduler()
    a = Request("a", list(range(20)), SamplingParams(max_tokens=2))
    sch.add_request(a)
    out = sch.schedule()
    sch.update_from_output(out, {"a": 7})
    b = Request("b", list(range(20)) + [99], SamplingParams(max_tokens=2))
    sch.add_request(b)
    out = sch.schedule()
    assert b.num_cached_tokens == 20
    assert kv.get_block_ids("a")[:5] == kv.get_block_ids("b")[:5]
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in kv.get_block_ids("b")[:5])
    kv.check_invariants()


def test_limits_are_clear_errors():
    sch, kv = make_scheduler(max_queue_len=2)
    with pytest.raises(ValueError, match="maximum context length"):
        sch.add_request(Request("x", [1] * 200, SamplingParams()))
    with pytest.raises(ValueError, match="exceeds the maximum context length"):
        sch.add_request(Request("y", [1] * 100, SamplingParams(max_tokens=150)))
    with pytest.raises(ValueError, match="empty"):
        sch.add_request(Request("z", [], SamplingParams()))
    sch.add_request(Request("a", [1], SamplingParams()))
    sch.add_request(Request("b", [1], SamplingParams()))
    with pytest.raises(QueueFullError):
        sch.add_request(Request("c", [1], SamplingParams()))
    small, _ = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        small.add_request(Request("big", [1] * 50, SamplingParams(max_tokens=1)))
