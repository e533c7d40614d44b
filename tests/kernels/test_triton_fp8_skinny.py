"""The swapped-operand FP8 decode GEMM on the GPU against the float64 twin (skipped without CUDA): 2 to 64 rows,
outputs and inputs not multiples of the tiles, every config knob (tile widths, stages, K splits, fast
accumulation), bias and residual, bf16 and fp16 output; quant_linear routes FP8 decode batches to it."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA", allow_module_level=True)
pytest.importorskip("triton")

from paged_cases import rel_err

from tokenmill.kernels import quant_ref, triton_fp8_linear, triton_fp8_skinny
from tokenmill.kernels.triton_fp8_skinny import SkinnyConfig, skinny_mm
from tokenmill.kernels.triton_quant import quant_linear
from tokenmill.quant.formats import QuantFormat, quantize

FP8 = QuantFormat.parse("fp8")
CONFIGS = [SkinnyConfig(), SkinnyConfig(num_stages=3), SkinnyConfig(64, 256, num_stages=3, programs_per_sm=2),
           SkinnyConfig(256, 128, num_warps=8, num_stages=4, programs_per_sm=4),
           SkinnyConfig(128, 128, fast_accum=True, programs_per_sm=3)]


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, FP8)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=dtype)
    bias = torch.randn(n, device="cuda", generator=gen, dtype=dtype)
    residual = torch.randn(m, n, device="cuda", generator=gen, dtype=dtype)
    return qw, x, bias, residual


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("m,n,k", [(2, 1000, 1104), (5, 4096, 4096), (16, 130, 4096), (17, 6144, 4096),
                                   (40, 4096, 14336), (64, 200, 576), (33, 1000, 2064), (64, 28672, 4096)])
def test_skinny_matches_twin(cfg: SkinnyConfig, m: int, n: int, k: int) -> None:
    qw, x, bias, residual = _case(m, n, k, torch.bfloat16, m + n + k)
    xq, xs = triton_fp8_linear.quantize_rows(x)
    poison = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    del poison  # the caching allocator hands these NaNs to the output: an element left unwritten shows
    got = skinny_mm(xq, xs, qw.qweight, qw.scales, bias, residual, torch.bfloat16, cfg)
    want = quant_ref.quant_linear(x, qw.qweight, qw.scales, None, k, k, bias.double(), residual=residual.double(),
                                  out_dtype=torch.float64)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert not got.isnan().any() and rel_err(got, want) < 1e-2


@pytest.mark.parametrize("split", [False, True])
def test_skinny_fp16_without_bias_or_residual(split: bool) -> None:
    """No bias, no residual, fp16 output, one K split or several: the same products as the twin."""
    m, n, k = 9, 2048 if split else 20480, 4096
    qw, x, _, _ = _case(m, n, k, torch.float16, 7)
    cfg = SkinnyConfig(programs_per_sm=4 if split else 1)
    xq, xs = triton_fp8_linear.quantize_rows(x)
    assert (triton_fp8_skinny.splits_for(cfg, n, k, x.device) > 1) == split
    got = skinny_mm(xq, xs, qw.qweight, qw.scales, None, None, torch.float16, cfg)
    want = quant_ref.quant_linear(x, qw.qweight, qw.scales, None, k, k, None, out_dtype=torch.float64)
    assert got.dtype == torch.float16 and rel_err(got, want) < 1e-2


def test_skinny_is_deterministic() -> None:
    """Split partial sums are added in split order, so a repeated call gives the same bits."""
    qw, x, bias, residual = _case(24, 4096, 14336, torch.bfloat16, 3)
    xq, xs = triton_fp8_linear.quantize_rows(x)
    runs = [skinny_mm(xq, xs, qw.qweight, qw.scales, bias, residual, torch.bfloat16) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("m", [2, 16, 17, 64, 65])
def test_quant_linear_routes_decode_batches(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 with bf16 output at 2 to MAX_ROWS rows runs skinny_mm, beyond it the tile kernel; the result is the
    twin's either way."""
    n, k = 4096, 4096
    qw, x, _, residual = _case(m, n, k, torch.bfloat16, m)
    calls = []
    real = triton_fp8_skinny.skinny_mm
    monkeypatch.setattr(triton_fp8_skinny, "skinny_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = quant_linear(x, qw.qweight, qw.scales, None, k, k, None, residual=residual)
    want = quant_ref.quant_linear(x, qw.qweight, qw.scales, None, k, k, None, residual=residual.double(),
                                  out_dtype=torch.float64)
    assert rel_err(got, want) < 1e-2
    assert bool(calls) == (m <= triton_fp8_skinny.MAX_ROWS)


def test_takes() -> None:
    bf16 = torch.bfloat16
    assert triton_fp8_skinny.takes(2, 4096, 4096, bf16) and triton_fp8_skinny.takes(64, 4096, 14336, torch.float16)
    assert not triton_fp8_skinny.takes(1, 4096, 4096, bf16)  # one row: the GEMV
    assert not triton_fp8_skinny.takes(65, 4096, 4096, bf16)
    assert not triton_fp8_skinny.takes(8, 4096, 4096, torch.float32)  # float32 logits: the tile kernel's fp16 dots
    assert not triton_fp8_skinny.takes(8, 4096, 1000, bf16)
    with pytest.raises(ValueError, match="block_n"):
        SkinnyConfig(block_n=32)
    with pytest.raises(ValueError, match="block_k"):
        SkinnyConfig(block_k=64)
