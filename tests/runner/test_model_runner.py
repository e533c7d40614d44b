"""How the model runner sizes the KV pool."""
import pytest
import torch

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.core.scheduler import ScheduledRequest, SchedulerOutput
from tokenmill.kernels import get_ops
from tokenmill.layers.attention import PagedAttention
from tokenmill.request import Request
from tokenmill.runner.model_runner import LaunchedStep, kv_bytes_per_token, pending_inputs
from tokenmill.runner.staging import device_tensor
from tokenmill.sampling_params import SamplingParams


def engine(**kw) -> LLMEngine:
    return LLMEngine.from_engine_args(load_format="dummy", model_preset="tiny-llama", skip_tokenizer_init=True,
                                      dtype="float32", block_size=16, **kw)


def test_pool_never_exceeds_what_max_num_seqs_requests_can_hold():
    """A budget far beyond need (a small model on a large GPU) gives one full-context table per request (plus
    the null block), not millions of blocks."""
    e = engine(kv_cache_memory=8 << 30, max_num_seqs=4, max_model_len=100)
    assert e.runner.num_blocks == 1 + 4 * 7
    assert e.get_stats()["num_blocks_total"] == 4 * 7  # usable: all but the null block


def test_pool_follows_the_budget_below_that():
    e = engine(kv_cache_memory=1 << 16, max_num_seqs=64, max_model_len=1024)
    per_block = kv_bytes_per_token(e.model_config, torch.float32) * 16
    assert e.runner.num_blocks == (1 << 16) // per_block < 1 + 64 * 64


def test_pool_given_in_tokens():
    """kv_cache_tokens: enough blocks for that many tokens over all requests, whatever the budget in bytes."""
    e = engine(kv_cache_tokens=100, max_num_seqs=4, max_model_len=64)
    assert e.get_stats()["num_blocks_total"] == 7  # 7 blocks of 16 hold the 100 tokens
    with pytest.raises(ValueError, match="not several"):
        engine(kv_cache_tokens=100, kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="not several"):
        engine(kv_cache_tokens=100, num_gpu_blocks_override=8)
    with pytest.raises(ValueError, match="at least one block"):
        engine(kv_cache_tokens=8)


def test_memory_profile_runs_the_whole_step_budget():
    """The profiling forward is the largest step the scheduler can form: a token budget beyond one context is
    several prompts of at most max_model_len tokens, capped at max_num_seqs of them, and the model sees every
    one of their tokens (a budget profiled as one max_model_len prompt left the rest of its activations out)."""
    e = engine(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=200)
    assert e.runner.worst_case_prefill() == [64, 64, 64, 8]
    assert engine(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=1000).runner.worst_case_prefill() == [64] * 4
    assert engine(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=48).runner.worst_case_prefill() == [48]
    seen = []
    hook = e.runner.model.model.embed_tokens.register_forward_hook(lambda mod, args, out: seen.append(out.shape[0]))
    try:
        e.runner._placeholder_prefill(e.runner.worst_case_prefill(), logits=True)
    finally:
        hook.remove()
    assert seen == [200]


def test_cache_is_stored_head_major_and_written_in_place():
    """Every layer's caches are views of the one pool, [block, token, KV head, d] over head-major storage; a
    request's K rows land in that storage at its blocks' (block, KV head, token) runs and nowhere else."""
    e = engine(max_num_seqs=2, max_model_len=64)
    layers = [m for m in e.runner.model.modules() if isinstance(m, PagedAttention)]
    for m in layers:
        assert m.k_cache.transpose(1, 2).is_contiguous() and m.v_cache.transpose(1, 2).is_contiguous()
        assert m.k_cache.untyped_storage().data_ptr() == e.runner.kv_cache.untyped_storage().data_ptr()
    e.add_request("a", list(range(1, 21)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    blocks = None
    while e.has_unfinished_requests():
        blocks = blocks or e.kv_cache.get_block_ids("a")
        e.step()
    written = layers[0].k_cache.abs().amax(dim=(2, 3)) > 0  # [block, token]
    want = torch.zeros_like(written)
    for t in range(21):  # the prompt and the first generated token (the last one is never fed back)
        want[blocks[t // 16], t % 16] = True
    assert torch.equal(written, want)


def test_sampler_compile_runs_on_the_lm_heads_logits_and_draws_nothing():
    """What the runner does at startup on CUDA (here with the twins): both sampling ops once on the LM head's
    logits, the sampler's generator untouched, so seeded and unseeded streams start where they would."""
    e = engine(max_num_seqs=2, max_model_len=64)
    state = e.runner.sampler.generator.get_state()
    e.runner._compile_sampler()
    assert torch.equal(e.runner.sampler.generator.get_state(), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pending_tokens_are_filled_without_waiting_for_the_device(no_device_sync) -> None:
    """Async scheduling's tokens still on the device go into the next input with nothing read back."""
    ids = torch.zeros(6, dtype=torch.long, device="cuda")
    token_src = device_tensor([-1, 2, -1, -1, 0, -1], torch.long, torch.device("cuda"))
    get_ops("cuda").fill_pending(ids, token_src, torch.arange(7, 10, device="cuda"))
    torch.cuda.set_sync_debug_mode(0)
    assert ids.tolist() == [0, 9, 0, 0, 7, 0]


def test_pending_inputs_name_the_rows_that_take_a_token_still_on_the_device() -> None:
    """A decode row and the last row of a prefill chunk that ends on the pending token take it; a request whose
    chunk stops short of it keeps its staged ids."""
    e = engine(max_num_seqs=4, max_model_len=64)
    reqs = [Request(str(i), list(range(3, 3 + n)), SamplingParams(max_tokens=8)) for i, n in enumerate((4, 6, 5))]
    for r in reqs:
        r.append_pending_token()
    reqs[0].num_computed_tokens = 4   # decode: one new token, the pending one
    reqs[1].num_computed_tokens = 2   # a chunk of 5 that ends on the pending token (index 6)
    reqs[2].num_computed_tokens = 0   # a chunk of 3 that stops before it
    sched = [ScheduledRequest(reqs[0], 1), ScheduledRequest(reqs[1], 5), ScheduledRequest(reqs[2], 3)]
    out = SchedulerOutput(scheduled=sched)
    batch = e.runner.prepare_input(out, [[1], [2], [3]])
    prev = LaunchedStep([reqs[2], reqs[1], reqs[0]], torch.zeros(3, dtype=torch.long), None)
    assert pending_inputs(out, batch, prev).tolist() == [2, -1, -1, -1, -1, 1, -1, -1, -1]
