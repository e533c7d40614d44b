"""Torch twins of the quantized kernels: the CPU implementation and the test oracle. Correct, not fast: a
linear dequantizes its whole weight on every call (the Triton kernels in triton_quant.py never do).

Quantized KV caches (the cache's dtype says which):
- float8_e4m3fn [num_blocks, block_size, num_kv_heads, head_dim]: values clamped to +-448 and cast; any
  per-tensor scale is folded into the model's weights beforehand (tokenmill/quant/kv_cache.py).
- int8 [num_blocks, block_size, num_kv_heads, head_dim + 4]: each (token, head) row holds head_dim int8
  values then its float32 scale in 4 bytes (little-endian), x = q * scale, scale = amax / 127.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.quant.formats import FP8_MAX, dequantize, quantize_fp8_rows

KV_SCALE_BYTES = 4


def fp8_activation(x: torch.Tensor, rms_norm: tuple[torch.Tensor, float] | None = None,
                   silu_and_mul: bool = False) -> torch.Tensor:
    """What an FP8 projection quantizes, in float32: x, or silu(gate) * up of x = cat(gate, up) (silu_and_mul),
    RMS-normalized with (weight, eps) where rms_norm is given; the producers' kernels folded into the
    quantization, so their output is never rounded to 16 bits (triton_fp8_linear.quantize_rows)."""
    xf = x.float()
    if silu_and_mul:
        gate, up = xf.chunk(2, dim=-1)
        xf = F.silu(gate) * up
    if rms_norm is not None:
        weight, eps = rms_norm
        xf = F.rms_norm(xf, (xf.shape[-1],), weight.float(), eps)
    return xf


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               rms_norm: tuple[torch.Tensor, float] | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """x @ W.T in float32 with x (fp8_activation's) quantized row by row to e4m3 and W e4m3 with a scale a row:
    what FP8 tensor cores compute, up to the order of the sums. The sums run in float64, where they are exact in
    any order (every product of two e4m3 values is a multiple of 2^-18 below 2^18, so K < 2^17 of them add up
    without rounding): a row's bits then depend on no other row. A float32 GEMM's blocking changes with the row
    count (its GEMV at one or two rows), and the next layer's e4m3 rounding turned those last bits into other
    greedy tokens."""
    act = fp8_activation(x, rms_norm, silu_and_mul)
    xq, xs = quantize_fp8_rows(act.reshape(-1, act.shape[-1]))
    y = (xq.double() @ qweight.double().T).float() * xs[:, None] * scales.float().view(1, -1)
    return y.view(*act.shape[:-1], -1)


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 in_features: int, group: int, bias: torch.Tensor | None, *,
                 residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 rms_norm: tuple[torch.Tensor, float] | None = None, silu_and_mul: bool = False,
                 silu_and_mul_out: bool = False) -> torch.Tensor:
    """x @ W.T + bias (+ residual) for a packed INT8 (int8 qweight) or INT4 (uint8 qweight) weight, in out_dtype
    (default x's); an FP8 weight (float8_e4m3fn) quantizes x too (fp8_linear), after the RMSNorm or SiLU·mul
    that produced it where those are folded in (rms_norm, silu_and_mul: FP8 only). silu_and_mul_out: W is
    cat(gate, up) and the result silu(gate) * up of the output, rounded to out_dtype first (what the Triton
    kernels store)."""
    if silu_and_mul_out:
        if residual is not None:
            raise ValueError("SiLU·mul of a projection's output takes no residual")
        gate, up = quant_linear(x, qweight, scales, mins, in_features, group, bias, out_dtype=out_dtype,
                                rms_norm=rms_norm, silu_and_mul=silu_and_mul).chunk(2, dim=-1)
        return F.silu(gate) * up  # torch_ref.silu_and_mul, which imports this module
    if qweight.dtype == torch.float8_e4m3fn:
        y = fp8_linear(x, qweight, scales, rms_norm, silu_and_mul)
        y = y if bias is None else y + bias.float()
        y = y if residual is None else y + residual.float()
        return y.to(out_dtype or x.dtype)
    check_no_prologue(rms_norm, silu_and_mul)
    y = F.linear(x, dequantize(qweight, scales, mins, in_features, group, x.dtype), bias)
    y = y if residual is None else y + residual
    return y if out_dtype is None else y.to(out_dtype)


def check_no_prologue(rms_norm: tuple[torch.Tensor, float] | None, silu_and_mul: bool) -> None:
    """Only FP8 projections fold the kernels that produce their input."""
    if rms_norm is not None or silu_and_mul:
        raise ValueError("only an FP8 weight folds an RMSNorm or SiLU·mul into its input quantization; "
                         "INT8 and INT4 projections take the producer's output")


def quantize_kv_int8(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_dim] float -> int8 rows [tokens, heads, head_dim + 4] with the scale in-band."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = xf * inv
    q = (torch.sign(q) * torch.floor(q.abs() + 0.5)).clamp(-127, 127).to(torch.int8)
    return torch.cat((q, scale.view(torch.int8)), dim=-1)


def dequantize_kv_int8(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., head_dim + 4] -> float32 [..., head_dim]."""
    scale = rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)
    return rows[..., :-KV_SCALE_BYTES].float() * scale


def to_kv_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """This step's keys or values in the cache's representation."""
    if cache_dtype == torch.int8:
        return quantize_kv_int8(x)
    if cache_dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)
    return x.to(cache_dtype)


def from_kv_cache(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows as values (int8 rows dequantized; other dtypes are cast by the attention itself)."""
    return dequantize_kv_int8(rows) if rows.dtype == torch.int8 else rows
