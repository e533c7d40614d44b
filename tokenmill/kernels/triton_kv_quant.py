"""Triton kernels for the int8 KV cache (layout in quant_ref.py: head_dim int8 values then a float32 scale in
each (token, head) row). The fp8 cache needs nothing here: its scales are folded into the weights, so the
float kernels in triton_attention.py / triton_rope_cache.py read and write it as they are.

Writing quantizes each (token, head) row with its own amax. Attention never dequantizes a tile: int8 is exact
in bf16/fp16/fp32, so QK^T runs on the raw values and each key's scale multiplies its score column, and each
value's scale multiplies its probability column before P @ V. The kernel here serves prefill (and decode steps
where rotary and cache write ran apart): a program takes BLOCK_R query rows of one KV head, rows being (token,
query head of the group) pairs, so in decode the whole group shares every K/V tile it loads. Decode steps take
triton_attention's decode kernel, which reads an int8 cache the same way, in partitions, with the step's rotary
and quantized cache write in the same launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.quant_ref import KV_SCALE_BYTES
from tokenmill.kernels.triton_attention import VARYING_ARGS, _kv_rows, quantize_int8_rows
from tokenmill.kernels.triton_rope_cache import rotary_embedding

_LOG2E = 1.4426950408889634


@triton.jit
def _write_int8_kernel(x_ptr, cache_ptr, cache_f32_ptr, slot_ptr, stride_xt, stride_xh,
                       stride_cb, stride_ct, stride_ch,
                       NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr):
    """One token: every head's row quantized with its own scale and stored at the token's slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, H_PAD)
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        x = tl.load(x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        q, scale = quantize_int8_rows(x, 1)
        # whole float32 words (see _attn_int8_kernel): 32-bit stores, not bytes
        row = tl.multiple_of((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + offs_h * stride_ch, 4)
        tl.store(cache_ptr + row[:, None] + offs_d[None, :], q, mask=mask)
        tl.store(cache_f32_ptr + (row + HEAD_DIM) // 4, scale, mask=offs_h < NUM_HEADS)


def _write(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return
    _write_int8_kernel[(num_tokens,)](
        x, cache, cache.view(torch.float32), slot_mapping, x.stride(0), x.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2),
        NUM_HEADS=num_heads, H_PAD=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=cache.shape[1], num_warps=4)


def write_kv_cache_int8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """Quantize this step's keys and values into their int8 cache slots (negative slot: skipped)."""
    assert k_cache.dtype == torch.int8 and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    _write(k, k_cache, slot_mapping)
    _write(v, v_cache, slot_mapping)


def rope_and_cache_int8(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotary on q and k, then rotated k and v quantized into the int8 cache; returns rotated q."""
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    write_kv_cache_int8(k, v, k_cache, v_cache, slot_mapping)
    return q


@triton.jit(do_not_specialize=VARYING_ARGS)
def _attn_int8_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
                      query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, scale_log2,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
                      table_cols,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One (tile of query tokens, KV head, sequence): rows r = (token r // GROUP, head r % GROUP)."""
    TOKENS: tl.constexpr = BLOCK_R // GROUP
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * TOKENS >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq)

    offs_r = tl.arange(0, BLOCK_R)
    tok = tile * TOKENS + offs_r // GROUP
    head = kv_head * GROUP + offs_r % GROUP
    r_mask = (offs_r < TOKENS * GROUP) & (tok < q_len)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = ctx - q_len + tok
    end = ctx - q_len + tl.minimum(tile * TOKENS + TOKENS, q_len)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # rows are whole float32 words (head_dim + 4 bytes), which Triton cannot see in strides like 132
        row, n_mask = _kv_rows(table, n0, end, kv_head, table_cols, stride_cb, stride_ct, stride_ch, BLOCK_SIZE,
                               BLOCK_N, 4)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0).to(q.dtype)
        k_scale = tl.load(k_scale_ptr + (row + HEAD_DIM) // 4, mask=n_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (k_scale * scale_log2)[None, :]
        qk = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0).to(q.dtype)
        v_scale = tl.load(v_scale_ptr + (row + HEAD_DIM) // 4, mask=n_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def paged_attention_int8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                         scale: float, max_query_len: int) -> torch.Tensor:
    """Causal attention over an int8 paged cache (same contract as torch_ref.paged_attention)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.dtype == torch.int8 and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.shape[3] == head_dim + KV_SCALE_BYTES
    group = num_heads // num_kv_heads
    block_r = max(16, triton.next_power_of_2(group)) if max_query_len == 1 else max(64, triton.next_power_of_2(group))
    block_n = 64 if q.element_size() < 4 else 32
    grid = (triton.cdiv(max_query_len, block_r // group), num_kv_heads, seq_lens.shape[0])
    _attn_int8_kernel[grid](
        q, k_cache, v_cache, k_cache.view(torch.float32), v_cache.view(torch.float32), out,
        query_start_loc, seq_lens, block_tables, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), block_tables.shape[1],
        GROUP=group, HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_R=block_r, BLOCK_N=block_n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2)
    return out
