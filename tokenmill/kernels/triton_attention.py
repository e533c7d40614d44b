"""Paged attention in Triton: flash-decoding for one query per sequence, varlen flash attention otherwise.

Both read K/V through the block table token by token (block id = table[pos // block_size]), so any
power-of-two block size works and no context is ever gathered into a dense copy. Table reads past the
table's width fall back to block 0: a context longer than its table reads wrong keys, never out-of-bounds
memory. Decode launches a fixed grid derived from tensor shapes only, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels import triton_fp8_decode
from tokenmill.kernels.triton_arrive import arrive_last, counters
from tokenmill.kernels.triton_gemv import num_sms
from tokenmill.kernels.triton_pdl import pdl_args, pdl_release, pdl_wait

_LOG2E = 1.4426950408889634

# Measured on an H200 (bf16, head dim 128, GQA 4). Decode: longest partition in tokens (halved for small
# batches, down to 256), tokens per loop step (fp32 inputs use 32), warps, pipeline stages; 1024/64/4/2 reads
# 3.8-4.0 TB/s at 64 x 4096. Prefill: (element bytes, padded head dim) -> (query tile, key tile, warps, stages).
DECODE_CFG = {"partition": 1024, "tile_n": 64, "num_warps": 4, "num_stages": 2, "early_pairs_per_sm": 1,
              "early_pairs_per_sm_int8": 0.5, "short_parts": 16}
# The block table's width changes from step to step; Triton would compile a kernel for each width that is 1, a
# multiple of 16 or neither, seconds each, in the middle of a benchmark or a user's first requests.
VARYING_ARGS = ("stride_bt", "table_cols")
# (query bytes, padded head dim) -> BLOCK_M, BLOCK_N, warps, stages. 16-bit, d 128: 64 x 64 tiles, 4 warps, 2 stages
# (H200, 2026-12-04, docs/BENCHMARKS.md): the offline workload's 65536-token prefill step (118 prompts of 100-1024
# tokens) 1.55 against 2.00-2.05 ms a layer with 128 x 128 / 8 warps / 3 stages on bf16 and e4m3 caches, one
# 8192-token prompt 1.44 against 1.52 (bf16) and 1.72 against 1.71 ms (e4m3).
PREFILL_CFG = {(2, 64): (128, 64, 4, 3), (2, 128): (64, 64, 4, 2), (2, 256): (64, 32, 8, 2),
               (4, 64): (32, 32, 8, 1), (4, 128): (32, 32, 8, 1), (4, 256): (16, 16, 4, 1)}
# Every query tile _paged_prefill can pick (PREFILL_CFG's, or smaller when a batch's longest query is short): each
# is its own compiled kernel, which the model runner compiles at startup.
PREFILL_QUERY_TILES = (16, 32, 64, 128)


@triton.jit
def _as(tile, DTYPE: tl.constexpr):
    """A K or V tile in the cache's dtype as DTYPE. An e4m3 tile is converted by PTX that Triton cannot move:
    left to itself the compiler converts after moving the bytes into the dot's layout, one shared-memory byte
    load an element."""
    if tile.dtype == tl.float8e4nv:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [tile.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4).to(DTYPE)
    return tile.to(DTYPE)


@triton.jit
def _kv_tile(ptrs, mask, DTYPE: tl.constexpr):
    """A K or V tile loaded as DTYPE (_as)."""
    return _as(tl.load(ptrs, mask=mask, other=0.0), DTYPE)


@triton.jit
def _cos_sin(cs_row, offs_d, HALF: tl.constexpr):
    """cos and sign-folded sin of the rotary row cs_row over a head's dims, in float32, for _rotate."""
    low = offs_d < HALF
    freq = tl.where(low, offs_d, offs_d - HALF)
    cos = tl.load(cs_row + freq, mask=offs_d < 2 * HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + HALF + freq, mask=offs_d < 2 * HALF, other=0.0).to(tl.float32)
    return cos, tl.where(low, -sin, sin)


@triton.jit
def _rotate(rows, offs_d, mask, cos, sin, HALF: tl.constexpr):
    """x[..., d] at rows + offs_d rotated neox style (as triton_rope_cache: x1 cos - x2 sin, x2 cos + x1 sin),
    in float32."""
    x = tl.load(rows + offs_d, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(rows + tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF), mask=mask, other=0.0)
    return x * cos + partner.to(tl.float32) * sin


@triton.jit
def _kv_rows(table, t0, end, kv_head, table_cols, stride_cb, stride_ct, stride_ch, BLOCK_SIZE: tl.constexpr,
             N: tl.constexpr, ALIGN: tl.constexpr):
    """Cache offsets of tokens t0 .. t0 + N of one KV head (through the block table), and which are before end.
    ALIGN: what every row's offset is known to be a multiple of, where Triton cannot see it (an int8 cache's
    rows of head_dim + 4 bytes: 132 at head dim 128, which Triton's specialization on multiples of 16 misses; told
    nothing, it loaded the tiles a byte at a time: 5,174 SASS instructions against e4m3's 2,050, sm_90)."""
    offs_n = t0 + tl.arange(0, N)
    n_mask = offs_n < end
    col = offs_n // BLOCK_SIZE
    block = tl.load(table + col, mask=n_mask & (col < table_cols), other=0).to(tl.int64)
    off = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
    if ALIGN > 1:
        off = tl.multiple_of(off, ALIGN)
    return off, n_mask


@triton.jit
def _row_scales(k_scale_ptr, v_scale_ptr, kv_off, n_mask, HEAD_DIM: tl.constexpr):
    """The float32 scales of int8 cache rows (at byte HEAD_DIM of each row; the pointers view the caches as
    float32)."""
    at = (kv_off + HEAD_DIM) // 4
    return tl.load(k_scale_ptr + at, mask=n_mask, other=0.0), tl.load(v_scale_ptr + at, mask=n_mask, other=0.0)


@triton.jit
def _kv_raw(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table, t0, end, kv_head, offs_d, d_mask,
            table_cols, stride_cb, stride_ct, stride_ch, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            TILE_N: tl.constexpr, ALIGN: tl.constexpr):
    """The K and V tiles of tokens t0 .. t0 + TILE_N (before end) in the cache's dtype, their rows' scales (an
    int8 cache; otherwise the token mask again, unused) and their token mask."""
    kv_off, n_mask = _kv_rows(table, t0, end, kv_head, table_cols, stride_cb, stride_ct, stride_ch, BLOCK_SIZE,
                              TILE_N, ALIGN)
    ptrs = kv_off[:, None] + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + ptrs, mask=kv_mask, other=0.0)
    k_scale = n_mask
    v_scale = n_mask
    if k_cache_ptr.dtype.element_ty == tl.int8:
        k_scale, v_scale = _row_scales(k_scale_ptr, v_scale_ptr, kv_off, n_mask, HEAD_DIM)
    return k, v, k_scale, v_scale, n_mask


@triton.jit
def quantize_int8_rows(x, AXIS: tl.constexpr):
    """Rows (along AXIS, the last) of float32 x as int8 with a scale each (amax / 127, rounded half away from
    zero: quant_ref.quantize_kv_int8): (values, scales)."""
    scale = tl.max(tl.abs(x), AXIS) / 127.0
    q = x * tl.expand_dims(tl.where(scale > 0, 1.0 / scale, 0.0), AXIS)
    q = tl.where(q >= 0, tl.floor(q + 0.5), -tl.floor(0.5 - q))
    return tl.clamp(q, -127.0, 127.0).to(tl.int8), scale


@triton.jit(do_not_specialize=VARYING_ARGS + ("short_parts",))
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_out_ptr, part_m_ptr,
                   part_l_ptr, counter_ptr, seq_lens_ptr, block_tables_ptr, k_new_ptr, v_new_ptr, positions_ptr,
                   cos_sin_ptr, slot_ptr, scale_log2,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
                   stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
                   table_cols, num_heads, num_kv_heads, num_parts, short_parts,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                   D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr, TILE_N: tl.constexpr,
                   P_CHUNK: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr, EARLY: tl.constexpr,
                   KV_ALIGN: tl.constexpr, PDL: tl.constexpr):
    """One (sequence, kv head, partition): all GROUP query heads of the kv head attend to the
    partition's tokens, so each K/V tile is loaded once and fed to one [GROUP_PAD, TILE_N] dot. A context of
    several partitions is merged by the partition program that finishes last (triton_arrive.py).

    ROPE: the step's rotary and cache write happen here (decode_attention_rope): q is rotated as it is loaded,
    and the sequence's new token (position ctx - 1, not in the cache yet) is rotated, written to its slot and
    attended to by the program of the last partition; the others read only cached tokens. One launch a layer
    less, and at batch 1 one fewer kernel boundary on the critical path.

    EARLY (with ROPE, whose cached tokens no kernel of this step writes: a block that a one-token step completes
    is no prefix hit before the next step, KVCacheManager.begin_step): everything but q and the new token is
    read before the PDL wait (lengths, rotary row, table, the first K/V tile), while the QKV projection still
    finishes, and each next tile is loaded while the current one is summed. Small batches, where one program's
    chain of dependent loads is the whole kernel's time: there a context is also cut into up to short_parts
    partitions of whole tiles (never longer than PARTITION), so that a short one is read by several programs, one
    tile each before their wait, instead of tile after tile by one.

    An int8 cache (kv_cache_dtype="int8"; k_scale_ptr and v_scale_ptr view it as float32, each row's scale at
    byte HEAD_DIM) is never dequantized: int8 is exact in q's dtype, so QK^T runs on the raw values, each key's
    scale multiplies its score and each value's its probability before P V (triton_kv_quant's kernel's
    arithmetic); ROPE quantizes the new token's rows as triton_kv_quant's writer does. KV_ALIGN: _kv_rows's ALIGN
    (4 for an int8 cache, whose rows are whole float32 words)."""
    pdl_release(PDL)
    if not EARLY:
        pdl_wait(PDL)
    INT8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.int8
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    # a context longer than the grid's partitions (than its block table) is cut, so that exactly cdiv(ctx,
    # part_len) programs arrive at the merge (triton_arrive.py; the grid has at least short_parts partitions)
    ctx = tl.minimum(tl.load(seq_lens_ptr + seq), num_parts * PARTITION)
    if EARLY:
        part_len = tl.minimum(tl.maximum(tl.cdiv(tl.cdiv(ctx, short_parts), TILE_N), 1) * TILE_N, PARTITION)
    else:
        part_len = PARTITION
    start = part * part_len
    if (start >= ctx) & (part > 0):
        return
    end = tl.minimum(start + part_len, ctx)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if ROPE:
        cos, sin = _cos_sin(cos_sin_ptr + tl.load(positions_ptr + seq).to(tl.int64) * stride_cs, offs_d,
                            HEAD_DIM // 2)
        cached_end = tl.minimum(end, ctx - 1)  # the new token is not in the cache yet
    else:
        cached_end = end
    if EARLY:
        k_nxt, v_nxt, ks_nxt, vs_nxt, n_nxt = _kv_raw(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table,
                                                      start, cached_end, kv_head, offs_d, d_mask, table_cols,
                                                      stride_cb, stride_ct, stride_ch, HEAD_DIM, BLOCK_SIZE, TILE_N,
                                                      KV_ALIGN)
        pdl_wait(PDL)
    q_rows = q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_mask = g_mask[:, None] & d_mask[None, :]
    if ROPE:
        q = _rotate(q_rows, offs_d[None, :], q_mask, cos[None, :], sin[None, :], HEAD_DIM // 2)
        q = q.to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q = q.to(tl.float16)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    if ROPE:  # the new token first (q is still in its load layout), by the program whose partition holds it
        if (end == ctx) & (ctx > 0):
            # rounded to k's dtype first, as rope_and_cache (and its int8 twin) stores it before the cache's dtype
            k_rot = _rotate(k_new_ptr + seq.to(tl.int64) * stride_kt + kv_head * stride_kh, offs_d, d_mask, cos, sin,
                            HEAD_DIM // 2).to(k_new_ptr.dtype.element_ty)
            v_new = tl.load(v_new_ptr + seq.to(tl.int64) * stride_vt + kv_head * stride_vh + offs_d, mask=d_mask,
                            other=0.0)
            slot = tl.load(slot_ptr + seq).to(tl.int64)
            c_row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
            if KV_ALIGN > 1:
                c_row = tl.multiple_of(c_row, KV_ALIGN)
            if INT8:  # each row quantized with its own scale, stored at byte HEAD_DIM (triton_kv_quant's writer)
                k_q, k_s = quantize_int8_rows(k_rot.to(tl.float32), 0)
                v_q, v_s = quantize_int8_rows(v_new.to(tl.float32), 0)
                tl.store(k_scale_ptr + (c_row + HEAD_DIM) // 4, k_s, mask=slot >= 0)
                tl.store(v_scale_ptr + (c_row + HEAD_DIM) // 4, v_s, mask=slot >= 0)
                k_val = k_q.to(tl.float32) * k_s
                v_val = v_q.to(tl.float32) * v_s
            else:
                k_q = k_rot.to(k_cache_ptr.dtype.element_ty)
                v_q = v_new.to(v_cache_ptr.dtype.element_ty)
                k_val = k_q.to(tl.float32)
                v_val = v_q.to(tl.float32)
            tl.store(k_cache_ptr + c_row + offs_d, k_q, mask=d_mask & (slot >= 0))
            tl.store(v_cache_ptr + c_row + offs_d, v_q, mask=d_mask & (slot >= 0))
            m_i = tl.sum(q.to(tl.float32) * k_val[None, :], 1) * scale_log2
            l_i = tl.full([GROUP_PAD], 1.0, tl.float32)
            acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32) + v_val[None, :]
    for t0 in range(start, cached_end, TILE_N):
        if EARLY:
            k, v, k_scale, v_scale, n_mask = _as(k_nxt, q.dtype), _as(v_nxt, q.dtype), ks_nxt, vs_nxt, n_nxt
            k_nxt, v_nxt, ks_nxt, vs_nxt, n_nxt = _kv_raw(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table,
                                                          t0 + TILE_N, cached_end, kv_head, offs_d, d_mask,
                                                          table_cols, stride_cb, stride_ct, stride_ch, HEAD_DIM,
                                                          BLOCK_SIZE, TILE_N, KV_ALIGN)
        else:
            kv_off, n_mask = _kv_rows(table, t0, cached_end, kv_head, table_cols, stride_cb, stride_ct, stride_ch,
                                      BLOCK_SIZE, TILE_N, KV_ALIGN)
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = _kv_tile(k_cache_ptr + kv_off[:, None] + offs_d[None, :], kv_mask, q.dtype)
            if INT8:
                k_scale, v_scale = _row_scales(k_scale_ptr, v_scale_ptr, kv_off, n_mask, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if INT8:  # int8 is exact in q's dtype: each key's scale multiplies its score, each value's its probability
            qk = qk * (k_scale * scale_log2)[None, :]
        else:
            qk = qk * scale_log2
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if not EARLY:
            v = _kv_tile(v_cache_ptr + kv_off[:, None] + offs_d[None, :], kv_mask, q.dtype)
        if INT8:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if ctx <= part_len:  # the whole context in this program: no partials, no merge
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        row = (seq * num_heads + heads).to(tl.int64) * num_parts + part
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_out_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=g_mask[:, None])
        if arrive_last(counter_ptr + seq * num_kv_heads + kv_head, tl.cdiv(ctx, part_len)):
            if EARLY:  # all heads at once: one round trip a chunk where latency is the kernel's time
                offs_h = tl.arange(0, GROUP_P2)
                group = kv_head * GROUP + offs_h
                _merge_heads(part_out_ptr, part_m_ptr, part_l_ptr,
                             out_ptr + seq.to(tl.int64) * stride_ot + group[:, None] * stride_oh,
                             (seq * num_heads + group).to(tl.int64) * num_parts, offs_h < GROUP,
                             tl.cdiv(ctx, part_len), GROUP_P2, HEAD_DIM, D_PAD, max(16 // GROUP_P2, 1))
            else:  # a head at a time: fewer registers (sm_90: 96 a thread against 128), for batches that fill the GPU
                for g in tl.static_range(GROUP):
                    head = kv_head * GROUP + g
                    _merge_partitions(part_out_ptr, part_m_ptr, part_l_ptr,
                                      out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh,
                                      (seq * num_heads + head).to(tl.int64) * num_parts, tl.cdiv(ctx, part_len),
                                      HEAD_DIM, D_PAD, P_CHUNK)


@triton.jit
def _merge_partitions(part_out_ptr, part_m_ptr, part_l_ptr, out_ptrs, base, n_valid,
                      HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, P_CHUNK: tl.constexpr):
    """One head's output from its n_valid partitions (rows base .. base + n_valid of the partials), P_CHUNK at a
    time in partition order, each partial sum rescaled to the running max. The partials were stored by other
    programs of this launch: read from L2 (.cg), never from this multiprocessor's L1."""
    offs_d = tl.arange(0, D_PAD)
    m_run = float("-inf")
    acc = tl.zeros([D_PAD], tl.float32)
    total = 0.0
    for p0 in range(0, n_valid, P_CHUNK):
        offs_c = p0 + tl.arange(0, P_CHUNK)
        c_mask = offs_c < n_valid
        m = tl.load(part_m_ptr + base + offs_c, mask=c_mask, other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 0))
        alpha = tl.exp2(m_run - m_new)
        w = tl.where(c_mask, tl.exp2(m - m_new), 0.0)
        l = tl.load(part_l_ptr + base + offs_c, mask=c_mask, other=0.0, cache_modifier=".cg")
        o = tl.load(part_out_ptr + (base + offs_c)[:, None] * D_PAD + offs_d[None, :], mask=c_mask[:, None],
                    other=0.0, cache_modifier=".cg")
        total = total * alpha + tl.sum(w * l, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m_run = m_new
    acc = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptrs + offs_d, acc.to(out_ptrs.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _merge_heads(part_out_ptr, part_m_ptr, part_l_ptr, out_rows, bases, h_mask, n_valid, H: tl.constexpr,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, P_CHUNK: tl.constexpr):
    """_merge_partitions for H heads at once (out_rows: [H, 1] pointers, bases: [H]), so each chunk's loads are one
    round trip for all of them."""
    offs_d = tl.arange(0, D_PAD)
    m_run = tl.full([H], float("-inf"), tl.float32)
    acc = tl.zeros([H, D_PAD], tl.float32)
    total = tl.zeros([H], tl.float32)
    for p0 in range(0, n_valid, P_CHUNK):
        offs_c = p0 + tl.arange(0, P_CHUNK)
        c_mask = h_mask[:, None] & (offs_c < n_valid)[None, :]
        rows = bases[:, None] + offs_c[None, :]
        m = tl.load(part_m_ptr + rows, mask=c_mask, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(part_l_ptr + rows, mask=c_mask, other=0.0, cache_modifier=".cg")
        o = tl.load(part_out_ptr + rows[:, :, None] * D_PAD + offs_d[None, None, :], mask=c_mask[:, :, None],
                    other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 1))
        alpha = tl.where(h_mask, tl.exp2(m_run - m_new), 0.0)  # a padding head's -inf - -inf stays out of the sums
        w = tl.where(c_mask, tl.exp2(m - m_new[:, None]), 0.0)
        total = total * alpha + tl.sum(w * l, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        m_run = m_new
    acc = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_rows + offs_d[None, :], acc.to(out_rows.dtype.element_ty),
             mask=h_mask[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit(do_not_specialize=VARYING_ARGS)
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr,
                    block_tables_ptr, scale_log2,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
                    table_cols,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One (query tile, head, sequence). Keys every row of the tile may see are processed unmasked,
    then the diagonal band with the causal mask. The last tiles launch first: they do the most work."""
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq)
    kv_head = head // GROUP

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = ctx - q_len + offs_m
    first_pos = ctx - q_len + m_tile * BLOCK_M
    end = ctx - q_len + tl.minimum(m_tile * BLOCK_M + BLOCK_M, q_len)
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(0, full_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col = offs_n // BLOCK_SIZE
        block = tl.load(table + col, mask=col < table_cols, other=0).to(tl.int64)
        kv_off = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        k = _kv_tile(k_cache_ptr + kv_off[:, None] + offs_d[None, :], d_mask[None, :], q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(v_cache_ptr + kv_off[:, None] + offs_d[None, :], d_mask[None, :], q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    for n0 in range(full_end, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kv_off, n_mask = _kv_rows(table, n0, end, kv_head, table_cols, stride_cb, stride_ct, stride_ch, BLOCK_SIZE,
                                  BLOCK_N, 1)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = _kv_tile(k_cache_ptr + kv_off[:, None] + offs_d[None, :], kv_mask, q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        qk = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(v_cache_ptr + kv_off[:, None] + offs_d[None, :], kv_mask, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact products (tf32 would cost ~1e-3 relative error); 16-bit ones ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_query_len: int) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context (see torch_ref)."""
    q = _last_dim_contiguous(q)
    assert k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    if max_query_len == 1:
        _paged_decode(q, k_cache, v_cache, seq_lens, block_tables, scale, out)
    else:
        _paged_prefill(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len, out)
    return out


class _Rope(NamedTuple):
    """What decode attention needs to rotate and cache the step's new token itself."""
    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor


def _small_batch(num_seqs: int, num_kv_heads: int, device: torch.device, int8: bool = False) -> bool:
    """At most early_pairs_per_sm (sequence, KV head) pairs a multiprocessor: _decode_kernel's EARLY regime. An int8
    cache, half as many (H100, batch 16 on Llama-3-8B's 8 KV heads: 2,435.6 tokens/s with the loads after the wait
    against 2,336.9 before it; batch 8 gains from them, docs/BENCHMARKS.md)."""
    per_sm = DECODE_CFG["early_pairs_per_sm_int8" if int8 else "early_pairs_per_sm"]
    return num_seqs * num_kv_heads <= per_sm * num_sms(device.index or 0)


def fuses_rope(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a decode step on this cache takes decode_attention_rope: a 16- or 32-bit float cache and an int8
    one always; an e4m3 one in small batches (EARLY), where one kernel boundary less on the critical path is the
    gain, while full batches read an e4m3 cache faster in triton_fp8_decode after rope_and_cache."""
    return k_cache.dtype != torch.float8_e4m3fn or _small_batch(q.shape[0], k_cache.shape[2], q.device)


def _paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, scale: float, out: torch.Tensor, rope: _Rope | None = None) -> None:
    """Split each context into fixed partitions (count from static shapes only: graph-capturable), attend per
    partition, and merge with a logsumexp-weighted reduce in the same launch; a sequence whose context fits one
    partition skips the partial buffers and the merge, whatever the batch's table width. An e4m3 cache goes to
    triton_fp8_decode where it supports the shapes. rope: the step's rotary and cache write in the same launch
    (q not yet rotated; _decode_kernel's ROPE)."""
    if rope is None and triton_fp8_decode.supports(q, k_cache, v_cache):
        triton_fp8_decode.fp8_decode(q, k_cache, v_cache, seq_lens, block_tables, scale, out)
        return
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_ctx = block_tables.shape[1] * block_size
    partition = DECODE_CFG["partition"]
    sms = num_sms(q.device.index or 0)
    # Long partitions read best, but a small batch needs more of them to give every multiprocessor work.
    while partition > 256 and num_seqs * num_kv_heads * triton.cdiv(max_ctx, partition) < sms:
        partition //= 2
    # EARLY: a batch with at most early_pairs_per_sm (sequence, KV head) pairs a multiprocessor, which the
    # latency of one program's dependent loads bounds (batch-1 INT8 decode, H200: 394.7 tokens/s against 390.2);
    # its short contexts are cut into up to short_parts partitions, about one program a multiprocessor in all
    # (batch-1 decode, H200, 2026-12-06: INT4 467.1 tokens/s against 458.3, INT8 412.2 against 404.5, bf16 252.0
    # against 249.9; fixed 64-token partitions lost on an H100 at 3000-token contexts and at batch 8)
    pairs = num_seqs * num_kv_heads
    early = rope is not None and _small_batch(num_seqs, num_kv_heads, q.device, k_cache.dtype == torch.int8)
    short_parts = min(DECODE_CFG["short_parts"], max(sms // pairs, 1)) if early else 1
    num_parts = max(triton.cdiv(max_ctx, partition), short_parts, 1)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    tile_n = DECODE_CFG["tile_n"] if q.element_size() < 4 else 32
    one = num_parts == 1
    pdl = pdl_args(q)
    if one:
        part_out = part_m = part_l = out  # unused
        counter = seq_lens
    else:
        part_out = torch.empty(num_seqs, num_heads, num_parts, d_pad, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        counter = counters(q.device, num_seqs * num_kv_heads)
    positions, k, v, cos_sin_cache, slot_mapping = rope or (seq_lens, q, q, q, seq_lens)  # unused without rope
    int8 = k_cache.dtype == torch.int8
    k_scales, v_scales = (k_cache.view(torch.float32), v_cache.view(torch.float32)) if int8 else (k_cache, v_cache)
    _decode_kernel[(num_seqs, num_kv_heads, num_parts)](
        q, k_cache, v_cache, k_scales, v_scales, out, part_out, part_m, part_l, counter, seq_lens, block_tables, k, v,
        positions, cos_sin_cache, slot_mapping, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0), block_tables.shape[1],
        num_heads, num_kv_heads, num_parts, short_parts,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), GROUP_P2=triton.next_power_of_2(group),
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, PARTITION=partition, TILE_N=tile_n,
        P_CHUNK=16,
        PRECISION=_precision(q.dtype), ROPE=rope is not None, EARLY=early, KV_ALIGN=4 if int8 else 1,
        num_warps=DECODE_CFG["num_warps"],
        num_stages=1 if early else DECODE_CFG["num_stages"], **pdl)


def decode_attention_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """One query per sequence: rotary on q and the new k, k and v written at slot_mapping, attention over the
    cache and the new token, in one launch (torch_ref.decode_attention: rope_and_cache, then paged_attention).
    The cache holds 16- or 32-bit floats, e4m3, or int8 rows with their scales (triton_kv_quant's layout)."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    assert k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride() and q.shape[-1] % 2 == 0
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0]:
        _paged_decode(q, k_cache, v_cache, seq_lens, block_tables, scale, out,
                      _Rope(positions, k, v, cos_sin_cache, slot_mapping))
    return out


def _paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, max_query_len: int,
                   out: torch.Tensor) -> None:
    """All sequences in one launch; the grid's first axis covers the longest query, shorter ones exit."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, warps, stages = PREFILL_CFG[(min(q.element_size(), 4), min(max(d_pad, 64), 256))]
    block_m = min(block_m, max(16, triton.next_power_of_2(max_query_len)))
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), block_tables.shape[1],
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q.dtype), num_warps=warps, num_stages=stages)
