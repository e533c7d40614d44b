"""Greedy output of the real default model must not depend on how requests are batched, chunked,
paged or preempted, and must equal Hugging Face transformers' greedy decoding."""
import pytest
import torch

from tokenmill import LLM, SamplingParams

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(chat_prompt_ids):
    """Each prompt run alone, default settings."""
    llm = LLM(dtype="float32")
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in chat_prompt_ids]


def test_matches_transformers_greedy(chat_prompt_ids, default_model_path):
    import os

    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(default_model_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    llm = LLM(dtype="float32")
    ours = llm.generate(chat_prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    eos = llm.llm_engine.eos_token_ids
    for ids, o in zip(chat_prompt_ids, ours):
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos)
        assert out[0, len(ids):].tolist() == o.outputs[0].token_ids


@pytest.mark.parametrize("engine_kwargs", [
    dict(),                                        # all prompts batched together
    dict(max_num_batched_tokens=16),               # chunked prefill forced on
    dict(block_size=1),
    dict(block_size=32),
    dict(enable_prefix_caching=False, block_size=16, max_num_batched_tokens=7),
])
def test_batched_equals_alone(chat_prompt_ids, reference, engine_kwargs):
    llm = LLM(dtype="float32", **engine_kwargs)
    outs = llm.generate(chat_prompt_ids, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_forced_preemption_keeps_output(chat_prompt_ids, reference):
    from tokenmill.runner.model_runner import kv_bytes_per_token
    llm = LLM(dtype="float32", max_model_len=256)
    per_token = kv_bytes_per_token(llm.llm_engine.model_config, torch.float32)
    # room for ~70 tokens in blocks of 16: the four requests (~40 + 24 tokens each) cannot all run
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory=per_token * 16 * 6)
    outs = llm.generate(chat_prompt_ids, GREEDY)
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.llm_engine.get_stats()["num_blocks_free"] == llm.llm_engine.get_stats()["num_blocks_total"]


def _prefill_rows_match_decode_rows() -> bool:
    """Whether this CPU's float32 SDPA (bf16 models' attention) gives a query row the same bits inside a
    prefill's block of rows as in a short query run, which attends row by row like decode
    (torch_ref.ROW_WISE_MAX_QUERY). It did on the AVX-512 machine this test was written on; on an AVX2-only one
    the last bits differ, so the tail of a chunked prompt differs from the same rows of the whole prompt, and in
    bf16 that can flip a near-tie."""
    from tokenmill.kernels import torch_ref
    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, dim, block = 35, 9, 3, 64, 16
    q = torch.randn(n, heads, dim, generator=gen)
    k_cache = torch.randn(4, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(4, block, kv_heads, dim, generator=gen)
    table = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([n], dtype=torch.int32)
    with pytest.MonkeyPatch.context() as m:  # the float32 kernel itself (float32 queries attend in float64)
        m.setattr(torch_ref, "_work_dtype", lambda dtype: torch.float32)
        whole = torch_ref.paged_attention(q, k_cache, v_cache, torch.tensor([0, n], dtype=torch.int32), seq_lens,
                                          table, dim ** -0.5, n)
        tail = torch_ref.paged_attention(q[32:], k_cache, v_cache, torch.tensor([0, 3], dtype=torch.int32),
                                         seq_lens, table, dim ** -0.5, 3)
    return torch.equal(whole[32:], tail)


@pytest.mark.parametrize("extra", [dict(), dict(max_num_batched_tokens=16, block_size=32)],
                         ids=["batched", "chunked"])
def test_cpu_fast_path_batched_equals_alone(chat_prompt_ids, extra):
    """bfloat16 with the GGUF's own INT4 weights (torch's packed CPU kernels, float32 SDPA with keys padded to a
    multiple of 64): batched and chunked, each prompt still gets the tokens it gets alone. (Prefix-cache hits are
    left out: they change how SDPA blocks a prompt's query rows, which moves the last bits of some rows; bf16
    rounding can then flip a near-tie, see docs/ARCHITECTURE.md.)"""
    if extra and not _prefill_rows_match_decode_rows():
        pytest.skip("this CPU's float32 SDPA gives a prefill row other bits than the same row attended alone "
                    "(seen on CPUs without AVX-512): a chunked prompt's short tail can then flip a bf16 near-tie")
    fast = dict(dtype="bfloat16", quantization="gguf", enable_prefix_caching=False)
    llm = LLM(**fast)
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in chat_prompt_ids]
    outs = LLM(**fast, **extra).generate(chat_prompt_ids, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone

@pytest.fixture(scope="module")
def fp8_alone(chat_prompt_ids):
    """FP8 weights in float32: an engine and each prompt's greedy tokens run alone on it."""
    llm = LLM(dtype="float32", quantization="fp8")
    return llm, [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in chat_prompt_ids]


@pytest.mark.parametrize("extra", [None, dict(), dict(max_num_batched_tokens=16), dict(block_size=32),
                                   dict(enable_prefix_caching=False, max_num_batched_tokens=7)],
                         ids=["prefix-hits", "batched", "chunked", "block32", "short-chunks"])
def test_fp8_batched_equals_alone(chat_prompt_ids, fp8_alone, extra):
    """FP8 weights and per-token activations in float32: a prompt's greedy tokens do not depend on its batch, its
    chunking, the block size or prefix-cache hits (None: the same prompts again on the engine that cached them).
    e4m3 rounds each layer's input to 3 mantissa bits, so a last-bit difference upstream can become another
    token: the twin's FP8 GEMM sums in float64 (kernels/quant_ref.fp8_linear) and float32 attention runs in
    float64 (kernels/torch_ref._work_dtype); with float32 attention, block size 32, 7-token chunks and prefix hits
    each changed a prompt's tokens."""
    llm, alone = fp8_alone
    if extra is not None:
        llm = LLM(dtype="float32", quantization="fp8", **extra)
    assert [o.outputs[0].token_ids for o in llm.generate(chat_prompt_ids, GREEDY)] == alone
