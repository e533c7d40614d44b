"""Rotary embedding and KV-cache writes in Triton, fused so q/k/v are read once per step.

One program per token handles every head: q and k are rotated in float32 (neox style, rotate halves)
and k/v land in the paged cache at slot_mapping; a negative slot (padding) writes nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_pdl import pdl_args, pdl_release, pdl_wait


@triton.jit
def _rope_cache_kernel(positions_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr,
                       k_cache_ptr, v_cache_ptr, slot_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
                       stride_cb, stride_ct, stride_ch,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr,
                       KV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, ROTATE: tl.constexpr, WRITE_CACHE: tl.constexpr,
                       PDL: tl.constexpr):
    """ROTATE: rotate q into q_out and k (into the cache, or k_out). WRITE_CACHE: store k and v at the slot."""
    pdl_release(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < half
    offs_kh = tl.arange(0, KV_PAD)
    kh_mask = (offs_kh < NUM_KV_HEADS)[:, None] & d_mask[None, :]
    k_lo = k_ptr + t * stride_kt + offs_kh[:, None] * stride_kh + offs_d[None, :]
    k1 = tl.load(k_lo, mask=kh_mask, other=0.0)
    k2 = tl.load(k_lo + half, mask=kh_mask, other=0.0)
    if ROTATE:
        pos = tl.load(positions_ptr + t).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0)[None, :]
        sin = tl.load(cos_sin_ptr + pos * stride_cs + half + offs_d, mask=d_mask, other=0.0)[None, :]
        offs_h = tl.arange(0, H_PAD)
        h_mask = (offs_h < NUM_HEADS)[:, None] & d_mask[None, :]
        q_lo = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
        q1 = tl.load(q_lo, mask=h_mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_lo + half, mask=h_mask, other=0.0).to(tl.float32)
        qo_lo = q_out_ptr + t * stride_qot + offs_h[:, None] * stride_qoh + offs_d[None, :]
        tl.store(qo_lo, (q1 * cos - q2 * sin).to(q_out_ptr.dtype.element_ty), mask=h_mask)
        tl.store(qo_lo + half, (q2 * cos + q1 * sin).to(q_out_ptr.dtype.element_ty), mask=h_mask)
        k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
        k1, k2 = (k1f * cos - k2f * sin).to(k_ptr.dtype.element_ty), (k2f * cos + k1f * sin).to(k_ptr.dtype.element_ty)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        c_mask = kh_mask & (slot >= 0)
        c_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
        c_lo = c_off + offs_kh[:, None] * stride_ch + offs_d[None, :]
        tl.store(k_cache_ptr + c_lo, k1.to(k_cache_ptr.dtype.element_ty), mask=c_mask)
        tl.store(k_cache_ptr + c_lo + half, k2.to(k_cache_ptr.dtype.element_ty), mask=c_mask)
        v_lo = v_ptr + t * stride_vt + offs_kh[:, None] * stride_vh + offs_d[None, :]
        tl.store(v_cache_ptr + c_lo, tl.load(v_lo, mask=c_mask, other=0.0).to(v_cache_ptr.dtype.element_ty),
                 mask=c_mask)
        tl.store(v_cache_ptr + c_lo + half,
                 tl.load(v_lo + half, mask=c_mask, other=0.0).to(v_cache_ptr.dtype.element_ty), mask=c_mask)
    else:
        ko_lo = k_out_ptr + t * stride_kot + offs_kh[:, None] * stride_koh + offs_d[None, :]
        tl.store(ko_lo, k1, mask=kh_mask)
        tl.store(ko_lo + half, k2, mask=kh_mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, heads, head_dim] with unit stride on the last dim (views of a fused qkv stay views)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(k: torch.Tensor, positions: torch.Tensor | None = None, q: torch.Tensor | None = None,
            cos_sin_cache: torch.Tensor | None = None, v: torch.Tensor | None = None,
            k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
            slot_mapping: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Rotate when cos_sin_cache is given, write the cache when k_cache is given; returns (q_out, k_out),
    k_out only when k is rotated without a cache. Unused pointer arguments get k (never dereferenced)."""
    rotate, write_cache = cos_sin_cache is not None, k_cache is not None
    k = _rows(k)
    num_tokens, num_kv_heads, head_dim = k.shape
    assert head_dim % 2 == 0
    q = _rows(q) if rotate else k
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if rotate else k
    k_out = k if write_cache else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if write_cache:
        v = _rows(v)
        assert k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    else:
        v = k_cache = v_cache = slot_mapping = k
    if not rotate:
        positions = cos_sin_cache = k
    if num_tokens:
        _rope_cache_kernel[(num_tokens,)](
            positions, q, k, v, cos_sin_cache, q_out, k_out, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_HEADS=q.shape[1], NUM_KV_HEADS=num_kv_heads, H_PAD=triton.next_power_of_2(q.shape[1]),
            KV_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
            HALF_PAD=triton.next_power_of_2(head_dim // 2), BLOCK_SIZE=k_cache.shape[1] if write_cache else 1,
            ROTATE=rotate, WRITE_CACHE=write_cache, num_warps=4, **pdl_args(k))
    return (q_out if rotate else None), (None if write_cache else k_out)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys and values into their cache slots (negative slot: skipped)."""
    _launch(k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on q and k; returns new tensors (inputs untouched)."""
    q_out, k_out = _launch(k, positions, q, cos_sin_cache)
    return q_out, k_out


def rope_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotary on q and k, rotated k and v into the cache, in one launch; returns rotated q."""
    q_out, _ = _launch(k, positions, q, cos_sin_cache, v, k_cache, v_cache, slot_mapping)
    return q_out
