"""The FP8 linear on the GPU against its torch twin (skipped without CUDA): activations quantized per row bit for
bit as the twin does (rows read once or, past 16,384 values, twice), and the product through every launch path
(the GEMV at one row, the tile kernel's float16 dots up to 16 rows or for float32 output, its e4m3 dots beyond,
cuBLAS's rowwise FP8 GEMM for prefill-sized bf16 output), with bias and residual, odd shapes and every dtype."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA", allow_module_level=True)
pytest.importorskip("triton")

from paged_cases import rel_err

from tokenmill.kernels import quant_ref, triton_fp8_linear
from tokenmill.kernels.triton_quant import MatmulConfig, quant_linear
from tokenmill.quant.formats import QuantFormat, quantize

FP8 = QuantFormat.parse("fp8")


@pytest.mark.parametrize("m,k", [(1, 1), (3, 31), (7, 4096), (300, 14336), (2, 5000), (3, 20000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_rows_equals_twin(m: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m + k)
    x = (torch.randn(m, k, device="cuda", generator=gen) * torch.logspace(-4, 4, m, device="cuda")[:, None]).to(dtype)
    x[m // 2] = 0
    q, s = triton_fp8_linear.quantize_rows(x)
    want_q, want_s = quant_ref.quantize_fp8_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k) and s.shape == (m,)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    scaled_back, s2 = triton_fp8_linear.quantize_rows(x, dequantize=True)  # what the one-row GEMV reads
    assert torch.equal(s2, want_s) and torch.equal(scaled_back, want_q.float() * want_s[:, None])


@pytest.mark.parametrize("m,k", [(1, 4096), (5, 576), (300, 14336), (3, 20000)])
@pytest.mark.parametrize("prologue", ["rms_norm", "silu_and_mul"])
def test_quantize_rows_folds_the_producer(m: int, k: int, prologue: str) -> None:
    """The RMSNorm or SiLU·mul that produced a projection's input, done in the quantization kernel (one pass up
    to 16,384 values, three or two beyond): the twin's values up to float32 rounding (sums in another order,
    another sigmoid), which moves a few e4m3 values by one step and the scale by an ulp or so."""
    gen = torch.Generator(device="cuda").manual_seed(m + k)
    x = torch.randn(m, 2 * k if prologue == "silu_and_mul" else k, device="cuda", generator=gen,
                    dtype=torch.bfloat16) * 3
    kwargs = ({"rms_norm": (torch.rand(k, device="cuda", generator=gen).to(torch.bfloat16) + 0.5, 1e-5)}
              if prologue == "rms_norm" else {"silu_and_mul": True})
    q, s = triton_fp8_linear.quantize_rows(x, **kwargs)
    want_q, want_s = quant_ref.quantize_fp8_rows(quant_ref.fp8_activation(x, **kwargs))
    assert q.shape == (m, k) and s.shape == (m,)
    assert torch.allclose(s, want_s, rtol=1e-5, atol=0)
    steps = (q.view(torch.uint8).int() - want_q.view(torch.uint8).int()).abs()
    assert steps.max() <= 1 and (steps > 0).float().mean() < 1e-3


@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_linear_folds_the_producer(m: int) -> None:
    """quant_linear with the folded RMSNorm and SiLU·mul on each launch path against the twin."""
    n, k = 4096, 1024
    gen = torch.Generator(device="cuda").manual_seed(m)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, FP8)
    norm = (torch.rand(k, device="cuda", generator=gen).to(torch.bfloat16) + 0.5, 1e-5)
    x_norm = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    x_gated = torch.randn(m, 2 * k, device="cuda", generator=gen, dtype=torch.bfloat16)
    for x, kwargs in ((x_norm, {"rms_norm": norm}), (x_gated, {"silu_and_mul": True})):
        want = quant_ref.quant_linear(x, qw.qweight, qw.scales, None, k, k, None, out_dtype=torch.float64, **kwargs)
        got = quant_linear(x, qw.qweight, qw.scales, None, k, k, None, **kwargs)
        assert got.shape == (m, n) and rel_err(got, want) < 1e-2


SHAPES = [(1, 4096, 4096), (1, 130, 1000), (3, 14336, 4096), (16, 4096, 14336), (17, 4096, 4096),
          (17, 130, 1000), (64, 6144, 4096), (100, 6144, 4096), (160, 4096, 4096), (300, 4096, 14336),
          (257, 1000, 576), (1100, 1000, 576)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_matches_twin(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, FP8)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=dtype)
    bias = torch.randn(n, device="cuda", generator=gen, dtype=dtype)
    residual = torch.randn(m, n, device="cuda", generator=gen, dtype=dtype)
    want = quant_ref.quant_linear(x, qw.qweight, qw.scales, None, k, k, bias.double(), residual=residual.double(),
                                  out_dtype=torch.float64)
    out = quant_linear(x, qw.qweight, qw.scales, None, k, k, bias, residual=residual)
    assert out.dtype == dtype and out.shape == (m, n) and not out.isnan().any()
    assert rel_err(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("m", [65, 128, 160, 192])
def test_mid_batches_dispatch_by_shape(m: int) -> None:
    """65-192 rows (Llama-3-8B's matrices): cuBLAS on the wide qkv and gate/up, the K-splitting tiles on o and
    down, where cuBLAS's unsplit 128 x 128 tiles are too few (the --fp8-gemm timings of docs/BENCHMARKS.md)."""
    bf16 = torch.bfloat16
    assert triton_fp8_linear.use_scaled_mm(m, 6144, 4096, bf16)
    assert triton_fp8_linear.use_scaled_mm(m, 28672, 4096, bf16)
    assert not triton_fp8_linear.use_scaled_mm(m, 4096, 4096, bf16)
    assert not triton_fp8_linear.use_scaled_mm(m, 4096, 14336, bf16)
    assert not triton_fp8_linear.use_scaled_mm(m, 6144, 4096, torch.float16)  # cuBLAS writes bf16 only


@pytest.mark.parametrize("cfg", [MatmulConfig(64, 64, 128, split_k=3), MatmulConfig(128, 128, 128, num_warps=8),
                                 MatmulConfig(64, 256, 256, num_stages=3, group_m=2),
                                 MatmulConfig(64, 128, 128, split_k=2, fast_accum=True)])
def test_e4m3_dot_configs(cfg: MatmulConfig) -> None:
    """The tile kernel's e4m3 dots (17 rows to prefill sizes) under every tile shape, split, row-tile grouping
    and accumulation, against the twin: rows past one tile, N and K not multiples of the tiles, a residual."""
    n, k = 1000, 1100
    gen = torch.Generator(device="cuda").manual_seed(cfg.block_n + cfg.split_k)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, FP8)
    for m in (17, 64, 130, 300):
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        residual = torch.randn(m, n, device="cuda", generator=gen, dtype=torch.bfloat16)
        want = quant_ref.quant_linear(x, qw.qweight, qw.scales, None, k, k, None, residual=residual.double(),
                                      out_dtype=torch.float64)
        got = quant_linear(x, qw.qweight, qw.scales, None, k, k, None, cfg, residual=residual)
        assert got.dtype == torch.bfloat16 and not got.isnan().any() and rel_err(got, want) < 1e-2


@pytest.mark.parametrize("m", [1, 16, 17, 64, triton_fp8_linear.SCALED_MM_MIN_ROWS])
def test_float32_logits_and_paths(m: int) -> None:
    """A quantized LM head's float32 output runs the tile kernel at every M; bf16 output from SCALED_MM_MIN_ROWS
    rows takes cuBLAS's FP8 GEMM (prefill), fewer the tile kernel's e4m3 dots (decode batches)."""
    n, k = 1024, 576
    gen = torch.Generator(device="cuda").manual_seed(m)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, FP8)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    got = quant_linear(x, qw.qweight, qw.scales, None, k, k, None, out_dtype=torch.float32)
    want = quant_ref.quant_linear(x, qw.qweight, qw.scales, None, k, k, None, out_dtype=torch.float64)
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-5
    fast = triton_fp8_linear.use_scaled_mm(m, n, k, torch.bfloat16)
    assert fast == (m >= triton_fp8_linear.SCALED_MM_MIN_ROWS)
