"""The FP8 linear on the GPU against its torch twin (skipped without CUDA): activations quantized per row bit for
bit as the twin does (rows read once or, past 16,384 values, twice), and the product through every launch path
(the GEMV at one row, the tile kernel up to 16 rows or for outputs other than bf16, cuBLAS's rowwise FP8 GEMM
beyond), with bias and residual, odd shapes and every dtype."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA", allow_module_level=True)
pytest.importorskip("triton")

from paged_cases import rel_err

from tokenmill.kernels import quant_ref, triton_fp8_linear
from tokenmill.kernels.triton_quant import quant_linear
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


SHAPES = [(1, 4096, 4096), (1, 130, 1000), (3, 14336, 4096), (16, 4096, 14336), (17, 4096, 4096), (17, 130, 1000),
          (64, 6144, 4096), (300, 4096, 14336), (257, 1000, 576)]


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


@pytest.mark.parametrize("m", [1, 16, 17, 64])
def test_float32_logits_and_paths(m: int) -> None:
    """A quantized LM head's float32 output runs the tile kernel at every M; bf16 output beyond 16 rows takes
    cuBLAS's FP8 GEMM on this GPU (the path the engine's big batches use)."""
    n, k = 1024, 576
    gen = torch.Generator(device="cuda").manual_seed(m)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, FP8)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    got = quant_linear(x, qw.qweight, qw.scales, None, k, k, None, out_dtype=torch.float32)
    want = quant_ref.quant_linear(x, qw.qweight, qw.scales, None, k, k, None, out_dtype=torch.float64)
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-5
    fast = triton_fp8_linear.use_scaled_mm(m, n, k, torch.bfloat16)
    assert fast == (m > 16 and torch.cuda.get_device_capability() >= (8, 9))
