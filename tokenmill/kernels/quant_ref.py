"""Torch twins of the quantized kernels: the CPU implementation and the test oracle. Correct, not fast: a
linear dequantizes its whole weight on every call (the Triton kernels in triton_quant.py never do).

One-row INT4 on integer dot products (triton_int4_idot.py): x in 16-bit fixed point per 32-input block
(quantize_x), then exact integer sums of nibbles times x (int4_idot_linear).

Quantized KV caches (the cache's dtype says which):
- float8_e4m3fn [num_blocks, block_size, num_kv_heads, head_dim]: values clamped to +-448 and cast; any
  per-tensor scale is folded into the model's weights beforehand (tokenmill/quant/kv_cache.py).
- int8 [num_blocks, block_size, num_kv_heads, head_dim + 4]: each (token, head) row holds head_dim int8
  values then its float32 scale in 4 bytes (little-endian), x = q * scale, scale = amax / 127.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.quant.formats import PACK_BLOCK, dequantize, round_half_away, unpack_int4

FP8_MAX = 448.0
KV_SCALE_BYTES = 4
X_BLOCK = PACK_BLOCK  # inputs of x a fixed-point scale covers (quantize_x): one INT4 packing block


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 in_features: int, group: int, bias: torch.Tensor | None, *,
                 residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ W.T + bias (+ residual) for a packed INT8 (int8 qweight) or INT4 (uint8 qweight) weight, in out_dtype
    (default x's)."""
    y = F.linear(x, dequantize(qweight, scales, mins, in_features, group, x.dtype), bias)
    y = y if residual is None else y + residual
    return y if out_dtype is None else y.to(out_dtype)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [K] float -> (xq int32 [KB * 32] in [-32768, 32767], d float32 [KB], sums float32 [KB]) over KB = ceil(K /
    32) blocks, zero-padded: x ~ xq * d block by block (why this fixed point: triton_int4_idot.py)."""
    k = x.numel()
    kb = -(-k // X_BLOCK)
    xf = F.pad(x.reshape(k).float(), (0, kb * X_BLOCK - k)).view(kb, X_BLOCK)
    amax = xf.abs().amax(1)
    exp = (amax.view(torch.int32) >> 23) & 0xFF  # biased exponent of the largest |x|
    d = ((exp - 14).clamp_min(1) << 23).view(torch.float32)
    inv = ((254 - (exp - 14).clamp_min(1)) << 23).view(torch.float32)  # 1 / d exactly
    xq = round_half_away(xf * inv[:, None]).clamp(-32768, 32767).to(torch.int32)
    return xq.view(-1), d, xf.sum(1)


def int4_idot_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                     in_features: int, group: int, bias: torch.Tensor | None = None, *,
                     residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Twin of triton_int4_idot.py: y = x @ W.T (+ bias, + residual) for one row of x, in x's fixed point
    (quantize_x), the block sums exact in integers, float64 for the rest."""
    xq, d, sums = quantize_x(x)
    kb = d.numel()
    n = qweight.shape[0]
    q = unpack_int4(qweight, kb * X_BLOCK).to(torch.int64)
    t = (q * xq.to(torch.int64)[None, :]).view(n, kb, X_BLOCK).sum(-1).double()  # exact
    g = torch.arange(kb, device=x.device) * X_BLOCK // group
    s, m = scales.double()[:, g], mins.double()[:, g]
    y = (t * s * d.double()[None, :] + m * sums.double()[None, :]).sum(1)
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.reshape(n).double()
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], n)


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
