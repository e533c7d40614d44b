"""LLMEngine.get_stats(): every figure the scheduler reports is there, and each moves when it must
(tiny dummy model, token-id prompts: milliseconds a step)."""
import time

import pytest

from tokenmill.core.scheduler import QueueFullError
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.request import RequestStatus
from tokenmill.sampling_params import SamplingParams

# what the scheduling spec asks get_stats() for, under the engine's names
REQUIRED_KEYS = {
    "num_running", "num_waiting", "num_preempted_waiting",                      # requests by state
    "num_blocks_total", "num_blocks_free", "num_blocks_cached", "kv_cache_usage",  # the KV pool
    "prefix_cache_queries", "prefix_cache_hits",                                # in tokens
    "num_preemptions", "num_aborts", "num_timeouts", "num_rejected",            # counters
    "last_step_prefill_reqs", "last_step_decode_reqs",                          # last step's batch
    "last_step_prefill_tokens", "last_step_decode_tokens",
}
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(**kw) -> LLMEngine:
    return LLMEngine.from_engine_args(load_format="dummy", model_preset="tiny-llama", skip_tokenizer_init=True,
                                      dtype="float32", block_size=16, max_model_len=256, **kw)


def tokens(n, start=3):
    return [3 + (start + i) % 250 for i in range(n)]


def run_to_end(e):
    while e.has_unfinished_requests():
        e.step()


def test_every_key_is_there_and_idle_values_add_up():
    """A fresh engine: every required key, nothing running, every block free, no counter started."""
    e = engine()
    stats = e.get_stats()
    assert REQUIRED_KEYS <= set(stats), REQUIRED_KEYS - set(stats)
    assert stats["num_blocks_total"] == e.kv_cache.usable_blocks > 0
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert stats["kv_cache_usage"] == 0.0
    assert all(stats[k] == 0 for k in REQUIRED_KEYS - {"num_blocks_total", "num_blocks_free", "kv_cache_usage"})


def test_a_prefill_step_then_decode_steps():
    """A step that runs prompts reports their tokens as prefill; a step where every request decodes reports
    one decode token per running request; the pool figures follow the blocks in use."""
    e = engine()
    prompts = [tokens(40, s) for s in (0, 100, 200)]
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, PARAMS)
    assert e.get_stats()["num_waiting"] == 3
    e.step()
    stats = e.get_stats()
    assert stats["last_step_prefill_tokens"] == 120 and stats["last_step_prefill_reqs"] == 3
    assert stats["last_step_decode_tokens"] == stats["last_step_decode_reqs"] == 0
    assert stats["num_running"] == 3 and stats["num_waiting"] == 0
    assert stats["num_blocks_free"] == stats["num_blocks_total"] - 3 * 3  # 40 tokens: 3 blocks of 16 each
    assert stats["kv_cache_usage"] == pytest.approx(9 / stats["num_blocks_total"])
    e.step()
    stats = e.get_stats()
    assert stats["last_step_decode_tokens"] == stats["last_step_decode_reqs"] == stats["num_running"] == 3
    assert stats["last_step_prefill_tokens"] == stats["last_step_prefill_reqs"] == 0
    run_to_end(e)
    stats = e.get_stats()
    assert stats["num_running"] == 0 and stats["num_blocks_free"] == stats["num_blocks_total"]
    # each finished request leaves its full blocks (47 computed tokens: 2 of 16) cached for reuse
    assert stats["num_blocks_cached"] == 3 * 2


def test_same_prompt_again_hits_the_prefix_cache():
    """Queries count every prompt token looked up; a second request with the same 40-token prompt is served
    its 2 full blocks (the last token is always computed)."""
    e = engine()
    p = tokens(40)
    e.add_request("a", p, PARAMS)
    run_to_end(e)
    stats = e.get_stats()
    assert stats["prefix_cache_queries"] == 40 and stats["prefix_cache_hits"] == 0
    e.add_request("b", p, PARAMS)
    run_to_end(e)
    stats = e.get_stats()
    assert stats["prefix_cache_queries"] == 80 and stats["prefix_cache_hits"] == 32


def test_abort_reject_and_timeout_counters():
    """An abort, a request refused by the full waiting queue and a request past its deadline each add one to
    their counter, and nothing else."""
    e = engine(max_queue_len=2)
    e.add_request("a", tokens(20), PARAMS)
    e.step()
    e.abort_request("a")
    e.abort_request("a")  # already finished: not counted again
    e.step()
    assert e.get_stats()["num_aborts"] == 1
    e.add_request("w1", tokens(20), PARAMS)
    e.add_request("w2", tokens(20), PARAMS)
    assert e.get_stats()["num_waiting"] == 2
    with pytest.raises(QueueFullError):
        e.add_request("w3", tokens(20), PARAMS)
    stats = e.get_stats()
    assert stats["num_rejected"] == 1 and stats["num_waiting"] == 2
    run_to_end(e)
    e.add_request("late", tokens(20), PARAMS, arrival_time=time.monotonic() - 2, timeout_s=1)
    e.step()
    stats = e.get_stats()
    assert stats["num_timeouts"] == 1
    assert stats["num_aborts"] == 1 and stats["num_rejected"] == 1
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_preemption_is_counted_and_shown_waiting():
    """Three requests that cannot fit 6 blocks of 16 together: preemptions are counted, and a preempted
    request shows in num_waiting and num_preempted_waiting until it runs again."""
    e = engine(num_gpu_blocks_override=7, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(3):
        e.add_request(str(i), tokens(24, 80 * i), params)
    seen = 0
    while e.has_unfinished_requests():
        e.step()
        stats = e.get_stats()
        preempted = [r for r in e.scheduler.waiting if r.status == RequestStatus.PREEMPTED]
        assert stats["num_preempted_waiting"] == len(preempted) <= stats["num_waiting"]
        assert stats["num_running"] + stats["num_waiting"] == e.scheduler.num_unfinished
        seen += bool(preempted)
    stats = e.get_stats()
    assert stats["num_preemptions"] > 0 and seen > 0
    assert stats["num_preempted_waiting"] == 0 and stats["num_blocks_free"] == stats["num_blocks_total"]
