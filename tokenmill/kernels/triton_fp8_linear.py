"""The FP8 (W8A8) linear's two CUDA pieces: activations quantized row by row to e4m3 in one Triton launch, and
cuBLAS's rowwise-scaled FP8 GEMM (`torch._scaled_mm`) for the rows the tensor cores are worth it for.

A row's scale is max|row| / 448 and every division is IEEE (div_rn), so the e4m3 values equal the torch twin's
(quant_ref.quantize_fp8_rows) bit for bit. Few rows (decode) go to triton_quant's tile kernel instead, which
reads the same e4m3 x and W and scales the same float32 sums, and one row to the GEMV (triton_gemv.py), which
reads x scaled back to float32: cuBLAS's FP8 GEMM at one row is slower than bf16's GEMV (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.quant.formats import FP8_MAX

SCALED_MM_MIN_ROWS = 17          # at most 16 rows run the tile kernel (triton_quant.SKINNY_M)
ONE_PASS_MAX = 16384             # longest row read once (64 float32 registers a thread with 8 warps)
ROW_BLOCK = 2048                 # longer rows: two passes of this many values at a time


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, FP8_MAX: tl.constexpr,
                          BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, DEQUANT: tl.constexpr):
    """ONE_PASS (a row fits one block): the row is read once and kept in registers; longer rows are read twice
    (max, then values). A one-row call is a chain of dependent loads, so passes are its latency."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.max(tl.abs(x), 0), FP8_MAX)
        _store_quantized(x, scale, q_row, offs, K, FP8_MAX, DEQUANT)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)))
        scale = tl.math.div_rn(tl.max(amax, 0), FP8_MAX)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            _store_quantized(x, scale, q_row, offs, K, FP8_MAX, DEQUANT)
    tl.store(s_ptr + row, scale)


@triton.jit
def _store_quantized(x, scale, q_row, offs, K, FP8_MAX: tl.constexpr, DEQUANT: tl.constexpr):
    safe = tl.maximum(scale, 1.1754943508222875e-38)  # float32's smallest normal: a zero row stays zeros
    q = tl.clamp(tl.math.div_rn(x, safe), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    if DEQUANT:
        tl.store(q_row + offs, q.to(tl.float32) * scale, mask=offs < K)
    else:
        tl.store(q_row + offs, q, mask=offs < K)


def quantize_rows(x: torch.Tensor, dequantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (e4m3 [M, K], float32 scales [M]), as quant_ref.quantize_fp8_rows; with
    dequantize, the e4m3 values come back times their scale in float32 (what the one-row GEMV reads)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float32 if dequantize else torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        one_pass = block <= ONE_PASS_MAX
        _quantize_rows_kernel[(m,)](x, q, scales, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                    BLOCK=block if one_pass else ROW_BLOCK, ONE_PASS=one_pass, DEQUANT=dequantize,
                                    num_warps=8 if one_pass and block > 4096 else 4)
    return q, scales


def use_scaled_mm(m: int, n: int, k: int, out_dtype: torch.dtype) -> bool:
    """Where cuBLAS's rowwise FP8 GEMM applies: bf16 output (the only one it writes with a scale a row), sizes
    in multiples of 16, and enough rows (QuantLinear refuses FP8 on GPUs older than compute capability 8.9)."""
    return m >= SCALED_MM_MIN_ROWS and out_dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0


def scaled_mm(xq: torch.Tensor, x_scales: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """(xq * x_scales) @ (qweight * w_scales).T + bias in bf16, float32 accumulation (no fast accumulation)."""
    return torch._scaled_mm(xq, qweight.t(), scale_a=x_scales.view(-1, 1), scale_b=w_scales.view(1, -1),
                            bias=None if bias is None else bias.to(torch.bfloat16), out_dtype=torch.bfloat16)
