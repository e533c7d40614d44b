"""KV bookkeeping of speculative steps without a model: the real scheduler and cache manager driven by random
drafts and random verification outcomes, with aborts, preemptions and prefix caching. After every step the
pool's invariants hold and no block registered in the prefix cache holds a rejected token."""
import random

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager, hash_block
from tokenmill.core.scheduler import Scheduler
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


def check_cached_blocks_hold_confirmed_tokens(sch: Scheduler, kv: KVCacheManager) -> None:
    bs = kv.block_size
    for rid, blocks in kv.req_to_blocks.items():
        req = sch.requests[rid]
        parent = None
        for i, b in enumerate(blocks[: req.num_computed_tokens // bs]):
            tokens = tuple(req.all_token_ids[i * bs:(i + 1) * bs])
            if b.block_hash is not None:
                assert b.token_ids == tokens and b.block_hash == hash_block(parent, tokens)
            parent = hash_block(parent, tokens)
        assert req.num_computed_tokens <= req.num_tokens
        assert len(blocks) * bs >= req.num_computed_tokens


def run_random(seed: int, caching: bool, num_blocks: int) -> tuple[Scheduler, KVCacheManager]:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, 4, caching)
    sch = Scheduler(SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8, max_model_len=200), kv)
    prefixes = [[rng.randrange(20) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    added, n_req, steps, verified = 0, 120, 0, 0
    while added < n_req or sch.num_unfinished:
        for _ in range(rng.randrange(0, 3)):
            if added < n_req:
                prompt = rng.choice(prefixes)[:] + [rng.randrange(20) for _ in range(rng.randrange(1, 30))]
                sch.add_request(Request(f"r{added}", prompt, SamplingParams(max_tokens=rng.randrange(1, 40))))
                added += 1
        out = sch.schedule()
        kv.check_invariants()
        for s in out.scheduled:
            assert s.num_spec_tokens == len(s.request.spec_token_ids)
        sampled = [s for s in out.scheduled if s.samples]
        # the verification: a random number of drafts accepted, then one more token
        emitted = {}
        for s in sampled:
            r = s.request
            a = rng.randrange(s.num_spec_tokens + 1)
            emitted[r.request_id] = r.spec_token_ids[:a] + [rng.randrange(20)]
            verified += s.num_spec_tokens > 0
        sch.update_from_output(out, {rid: t[0] for rid, t in emitted.items()})
        for s in sampled:
            r, more = s.request, emitted[s.request.request_id][1:]
            for t in more:
                if r.num_output_tokens >= r.sampling_params.max_tokens:
                    break
                r.append_token(t)
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sch.finish_request(r, RequestStatus.FINISHED_LENGTH)
                continue
            if s.num_spec_tokens:
                sch.rollback_rejected(r)
            limit = r.sampling_params.max_tokens - r.num_output_tokens - 1
            r.spec_token_ids = [rng.randrange(20) for _ in range(min(rng.randrange(0, 5), limit))]
        if rng.random() < 0.03 and sch.requests:
            sch.abort_request(rng.choice(sorted(sch.requests)))
        kv.check_invariants()
        check_cached_blocks_hold_confirmed_tokens(sch, kv)
        steps += 1
        assert steps < 20000, "scheduler stalled"
    assert kv.num_free_blocks == kv.usable_blocks and not kv.req_to_blocks
    assert verified > 100
    return sch, kv


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("caching", [True, False])
def test_random_speculative_steps_account_every_block(seed, caching):
    _, kv = run_random(seed, caching, num_blocks=200)
    if caching:
        assert kv.prefix_hits > 0


def test_tight_pool_preempts_and_drafts_never_do():
    sch, _ = run_random(11, True, num_blocks=40)
    assert sch.stats.num_preemptions > 0


def test_rollback_frees_emptied_blocks_and_keeps_accepted():
    kv = KVCacheManager(32, 4, True)
    sch = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=100), kv)
    r = Request("a", list(range(7)), SamplingParams(max_tokens=50))
    sch.add_request(r)
    out = sch.schedule()
    sch.update_from_output(out, {"a": 7})                 # 8 tokens, 7 computed
    r.spec_token_ids = [8, 9, 10, 11, 12, 13]             # slots up to position 13: 4 blocks
    out = sch.schedule()
    assert out.scheduled[0].num_new_tokens == 7 and len(kv.get_block_ids("a")) == 4
    assert kv.num_cached_blocks["a"] == 2                 # only blocks of confirmed tokens are registered
    sch.update_from_output(out, {"a": 8})                 # first draft accepted
    r.append_token(99)                                    # then the second is rejected: 99 instead
    sch.rollback_rejected(r)
    assert r.num_computed_tokens == 9 and r.num_tokens == 10 and not r.spec_token_ids
    assert len(kv.get_block_ids("a")) == 3                # the block of positions 12..15 went back
    kv.check_invariants()
