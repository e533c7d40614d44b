"""The FP8 (W8A8) linear's two CUDA pieces: activations quantized row by row to e4m3 in one Triton launch, and
cuBLAS's rowwise-scaled FP8 GEMM (`torch._scaled_mm`) for the rows the tensor cores are worth it for.

A row's scale is max|row| / 448, its values are multiplied by the scale's reciprocal (one IEEE division a row,
not one a value: the gated rows of a prefill step were bound by instruction issue), and both the division and the
product round to nearest, so the e4m3 values equal the torch twin's (quant_ref.quantize_fp8_rows) bit for bit.
Decode batches go to triton_quant's tile kernel instead (use_scaled_mm says where), which reads the same e4m3 x
and W and scales the same float32 sums, and one row to the GEMV (triton_gemv.py), which reads x scaled back to
float32: cuBLAS's FP8 GEMM at one row is slower than bf16's GEMV (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_pdl import pdl_args, pdl_release, pdl_wait
from tokenmill.quant.formats import FP8_MAX

TILE_ONLY_ROWS = 64              # up to this many rows the tile kernel's e4m3 dots beat cuBLAS on every matrix
SCALED_MM_MIN_ROWS = 193         # from here cuBLAS wins on every matrix; between, on the wide ones (use_scaled_mm)
ONE_PASS_MAX = 16384             # longest row read once (64 float32 registers a thread with 8 warps)
ROW_BLOCK = 2048                 # longer rows: two passes of this many values at a time


@triton.jit
def _quantize_rows_kernel(x_ptr, g_ptr, q_ptr, s_ptr, K, eps, stride_xm, stride_qm, FP8_MAX: tl.constexpr,
                          BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, DEQUANT: tl.constexpr,
                          GATED: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """ONE_PASS (a row fits one block): the row is read once and kept in registers; longer rows are read twice
    (max, then values), three times with NORM (sum of squares first). A one-row call is a chain of dependent
    loads, so passes are its latency. GATED: the row is cat(gate, up), 2 K wide, and silu(gate) * up is what is
    quantized; NORM: the row RMS-normalized and times g_ptr's weight (the producers' kernels, fused)."""
    pdl_release(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        x = _activation(x_row, offs, K, GATED)
        if NORM:
            x = _normalized(x, _inv_rms(tl.sum(x * x, 0), K, eps), g_ptr, offs, K)
        scale = tl.math.div_rn(tl.max(tl.abs(x), 0), FP8_MAX)
        _store_quantized(x, scale, q_row, offs, K, FP8_MAX, DEQUANT)
    else:
        inv_rms = 1.0
        if NORM:
            squares = tl.zeros([BLOCK], tl.float32)
            for k0 in range(0, K, BLOCK):
                x = _activation(x_row, k0 + tl.arange(0, BLOCK), K, GATED)
                squares += x * x
            inv_rms = _inv_rms(tl.sum(squares, 0), K, eps)
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = _activation(x_row, offs, K, GATED)
            if NORM:
                x = _normalized(x, inv_rms, g_ptr, offs, K)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.max(amax, 0), FP8_MAX)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = _activation(x_row, offs, K, GATED)
            if NORM:
                x = _normalized(x, inv_rms, g_ptr, offs, K)
            _store_quantized(x, scale, q_row, offs, K, FP8_MAX, DEQUANT)
    tl.store(s_ptr + row, scale)


@triton.jit
def _activation(x_row, offs, K, GATED: tl.constexpr):
    """The values to quantize at offs, in float32: the row's, or silu(gate) * up of a cat(gate, up) row."""
    x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(x_row + K + offs, mask=offs < K, other=0.0).to(tl.float32)
        x = x * tl.sigmoid(x) * up
    return x


@triton.jit
def _inv_rms(sum_squares, K, eps):
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(sum_squares / K + eps))


@triton.jit
def _normalized(x, inv_rms, g_ptr, offs, K):
    return x * inv_rms * tl.load(g_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)


@triton.jit
def _store_quantized(x, scale, q_row, offs, K, FP8_MAX: tl.constexpr, DEQUANT: tl.constexpr):
    safe = tl.maximum(scale, 1.1754943508222875e-38)  # float32's smallest normal: a zero row stays zeros
    q = tl.clamp(x * tl.math.div_rn(1.0, safe), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    if DEQUANT:
        tl.store(q_row + offs, q.to(tl.float32) * scale, mask=offs < K)
    else:
        tl.store(q_row + offs, q, mask=offs < K)


def quantize_rows(x: torch.Tensor, dequantize: bool = False, *, rms_norm: tuple[torch.Tensor, float] | None = None,
                  silu_and_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (e4m3 [M, K], float32 scales [M]), as quant_ref.quantize_fp8_rows; with
    dequantize, the e4m3 values come back times their scale in float32 (what the one-row GEMV reads).
    rms_norm (weight, eps): rows RMS-normalized first; silu_and_mul: x is [M, 2 K], cat(gate, up), and
    silu(gate) * up is quantized (quant_ref.fp8_activation): the kernels that produce a projection's input,
    folded into its quantization, without their 16-bit output in memory."""
    m, k = x.shape[0], x.shape[1] // 2 if silu_and_mul else x.shape[1]
    q = torch.empty(m, k, dtype=torch.float32 if dequantize else torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        one_pass = block <= ONE_PASS_MAX
        warps = (16 if silu_and_mul and block > 8192 else 8) if one_pass and block > 4096 else 4
        weight, eps = rms_norm if rms_norm is not None else (x, 0.0)
        _quantize_rows_kernel[(m,)](x, weight, q, scales, k, eps, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                    BLOCK=block if one_pass else ROW_BLOCK, ONE_PASS=one_pass, DEQUANT=dequantize,
                                    GATED=silu_and_mul, NORM=rms_norm is not None, num_warps=warps,
                                    **pdl_args(x))
    return q, scales


def use_scaled_mm(m: int, n: int, k: int, out_dtype: torch.dtype) -> bool:
    """Where cuBLAS's rowwise FP8 GEMM applies and is the faster: bf16 output (the only one it writes with a
    scale a row), sizes in multiples of 16, and rows enough that its 128-row output tiles are worth their padding;
    otherwise the tile kernel, which splits K to fill the GPU, wins (`python -m tokenmill.quant.bench --fp8-gemm`
    on the H200, Llama-3-8B's four matrices, cuBLAS with fast accumulation: the tile kernel at 17-64 rows on every
    matrix; at 65-192 on the matrices with no more outputs than inputs (o, down), which cuBLAS covers with too few
    tiles and does not split; cuBLAS on qkv and gate/up there, and on every matrix from 193 rows). QuantLinear
    refuses FP8 on GPUs older than compute capability 8.9."""
    if out_dtype != torch.bfloat16 or n % 16 or k % 16 or m <= TILE_ONLY_ROWS:
        return False
    return m >= SCALED_MM_MIN_ROWS or n > k


def scaled_mm(xq: torch.Tensor, x_scales: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor,
              bias: torch.Tensor | None, fast_accum: bool = True) -> torch.Tensor:
    """(xq * x_scales) @ (qweight * w_scales).T + bias in bf16. fast_accum (the engine's): the tensor cores'
    narrower accumulator over the whole of K, as vLLM's CUTLASS FP8 kernels on sm_90 (FP8FastAccum schedules)
    accumulate; 8-13% faster from 1,024 rows and on gate/up (docs/BENCHMARKS.md). Without it, partial sums move
    into float32 as the tile kernel's do; the benchmark times both."""
    return torch._scaled_mm(xq, qweight.t(), scale_a=x_scales.view(-1, 1), scale_b=w_scales.view(1, -1),
                            bias=None if bias is None else bias.to(torch.bfloat16), out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)
