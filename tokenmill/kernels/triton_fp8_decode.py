"""Decode attention over an e4m3 (fp8) paged KV cache, in Gluon (Triton's explicit-layout dialect): one warp a
(sequence, KV head, partition) reads the cache bytes straight into the registers the tensor cores take them from
and converts them there, never through shared memory.

Why: the Triton decode kernel (triton_attention.py) moves an fp8 tile from global to shared memory, to registers
(converted to fp16), back to shared memory and into the dot's layout: six bytes of shared-memory traffic an
element where a bf16 cache needs four. On the H200 (256 sequences x 1024 tokens) Nsight Compute showed its L1 /
shared pipe 81% busy while DRAM delivered 2.3 TB/s, so an fp8 cache decoded no faster than a bf16 one.

The products are transposed so that no register of an mma.sync.m16n8k16 is padding: S^T = K Q^T takes 16 keys as
its rows and the (at most 8) query heads of the KV head as its columns, and O^T = V^T P^T takes 16 of the head
dim's d as rows, the chunk's 16 tokens as its k and the heads as columns. Lane l (g = l // 4, t = l % 4) loads
keys g and g + 8 of a chunk, bytes [t D/4, (t + 1) D/4) of their rows; word s of those bytes is its part of k16
step s. A sum over d does not depend on the order of d, so Q is loaded in the same order. For V^T the lane needs
tokens 2t, 2t + 1, 2t + 8 and 2t + 9; it loads bytes [g D/8, (g + 1) D/8) of those four rows and pairs the tokens'
bytes with byte permutes, so its rows of m16 tile 2i + h are d = g D/8 + 4i + 2h (row g) and that + 1 (row g + 8).
P^T leaves S^T's accumulators as f16 pairs and is transposed into the B fragment by movmatrix, two 8x8 tiles a
chunk. Arithmetic is the Triton kernel's: fp16 operands (q rounded to fp16, e4m3 exact in fp16), fp32
accumulation, exp2 softmax with the scale folded in, partitions merged by the program that arrives last
(triton_arrive.py)."""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenmill.kernels import triton_split
from tokenmill.kernels.triton_arrive import arrive_last, counters
from tokenmill.kernels.triton_gemv import num_sms
from tokenmill.kernels.triton_pdl import pdl_args

_arrive_last = gluon.jit(arrive_last.fn)
_LOG2E = 1.4426950408889634

RESCALE_LOG2 = gl.constexpr(8.0)  # see _step
CHUNK_TOKENS = 16  # tokens a loop step: two n8 tiles of S^T, one k16 step of O^T
CHUNK = gl.constexpr(CHUNK_TOKENS)
HEAD_DIMS = (64, 128)
MAX_GROUP = 8  # query heads a KV head: the 8 columns of the mma
# Partitions (triton_split.py): multiples of min_partition tokens (a power of two of at least two chunks, one trip
# of the loop), at most max_partition, a context cut into enough of them for about programs_per_sm one-warp
# programs a multiprocessor, into at most max_splits unless partitions of max_partition need more. Searched on the
# H200 (docs/BENCHMARKS.md); max_partition 1024 rather than 512 since 2026-12-02: at 128 registers a thread an SM
# holds 16 of these warps, and a batch that fills the GPU by itself (129 sequences and more) then runs a context
# of up to 1,024 tokens in one program, one wave and no merge (offline workload: its steps at 129-192 and 193-256
# sequences 8.56 -> 8.22 and 9.51 -> 9.32 ms).
FP8_DECODE_CFG = {"max_partition": 1024, "min_partition": 128, "programs_per_sm": 8, "max_splits": 64}
_partition_len = gluon.jit(triton_split.partition_len.fn)


@gluon.jit
def _e4m3_pairs(w):
    """32-bit words of four e4m3 bytes -> the f16x2 pairs of bytes (0, 1) and (2, 3)."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
        constraints="=r,=r,r", args=[w], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _e4m3_token_pairs(a, b):
    """Words of four e4m3 bytes of two tokens (a: d .. d + 3 of one, b: of the other) -> four f16x2 pairs
    (token a, token b), one for each d."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 x, y;
        .reg .b16 l, h;
        prmt.b32 x, $4, $5, 0x5140;
        prmt.b32 y, $4, $5, 0x7362;
        mov.b32 {l, h}, x;
        cvt.rn.f16x2.e4m3x2 $0, l;
        cvt.rn.f16x2.e4m3x2 $1, h;
        mov.b32 {l, h}, y;
        cvt.rn.f16x2.e4m3x2 $2, l;
        cvt.rn.f16x2.e4m3x2 $3, h;
        }""",
        constraints="=r,=r,=r,=r,r,r", args=[a, b], dtype=(gl.int32,) * 4, is_pure=True, pack=1)


@gluon.jit
def _f16x2(lo, hi):
    """Two fp32 values -> one f16x2 word (lo in the low half, the smaller k of an mma pair)."""
    return gl.inline_asm_elementwise(asm="cvt.rn.f16x2.f32 $0, $2, $1;", constraints="=r,f,f", args=[lo, hi],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A B + C, m16n8k16 with f16 operands (pairs in 32-bit words) and fp32 accumulators."""
    return gl.inline_asm_elementwise(
        asm="mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
            "{$10,$11,$12,$13};",
        constraints="=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(gl.float32,) * 4, is_pure=True, pack=1)


@gluon.jit
def _transpose(x):
    """The 8x8 f16 matrix a warp holds as (lane g, t: row g, columns 2t, 2t + 1), transposed in the same layout."""
    return gl.inline_asm_elementwise(asm="movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", constraints="=r,r",
                                     args=[x], dtype=gl.int32, is_pure=True, pack=1)


def _butterfly(op: str) -> gl.constexpr:
    """PTX reducing $1 with `op` over the 8 lanes of one t (the rows g of a column of an mma accumulator) into $0,
    the same in each of them."""
    steps = "".join(f"shfl.sync.bfly.b32 o, {src}, {mask}, 0x1f, 0xffffffff; {op}.f32 $0, {src}, o; "
                    for src, mask in (("$1", 4), ("$0", 8), ("$0", 16)))
    return gl.constexpr("{ .reg .f32 o; " + steps + "}")


_COL_MAX = _butterfly("max")
_COL_SUM = _butterfly("add")


@gluon.jit
def _across_rows(x, ASM: gl.constexpr):
    """x reduced over the rows g of its mma column by ASM (_COL_MAX, _COL_SUM)."""
    return gl.inline_asm_elementwise(asm=ASM, constraints="=f,f", args=[x], dtype=gl.float32, is_pure=False,
                                     pack=1)


@gluon.jit
def _load_chunk(k_ptr, v_ptr, table, c, last, end, table_cols, k_word, k_tok, v_word, v_tok, stride_cb, stride_ct,
                head_off, BLOCK_SIZE: gl.constexpr):
    """The K and V words of the chunk at token c (a chunk lies in one block), without masks: a chunk past the
    partition's last one reads the last one again, a token at or past end reads token end - 1. Their scores are
    masked to -inf, so they add 0 times a finite value."""
    c = gl.maximum(gl.minimum(c, last), 0)
    col = c // BLOCK_SIZE
    block = gl.load(table + col, mask=col < table_cols, other=0).to(gl.int64)
    row = block * stride_cb + head_off + (c % BLOCK_SIZE) * stride_ct
    in_chunk = gl.maximum(end - 1 - c, 0)
    kw = gl.load(k_ptr + row + gl.minimum(k_tok, in_chunk) * stride_ct + k_word)
    vw = gl.load(v_ptr + row + gl.minimum(v_tok, in_chunk) * stride_ct + v_word)
    return kw, vw


@gluon.jit
def _store_cols(acc, d, ok, out_row, part_row, l_tot, split):
    """One accumulator ([lanes, words]: columns d of one head a lane) to the output, normalized, or to the
    partials."""
    if split:
        gl.store(part_row + d, acc, mask=ok)
    else:
        val = acc / gl.where(l_tot > 0, l_tot, 1.0)
        gl.store(out_row + d, val.to(out_row.dtype.element_ty), mask=ok)


@gluon.jit
def _merge(part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, base, n_valid, HEAD_DIM: gl.constexpr,
           P_CHUNK: gl.constexpr):
    """One head's output from its n_valid partitions (rows base .. base + n_valid of the partials), P_CHUNK at a
    time in partition order (triton_attention._merge_partitions); read from L2 (.cg): other programs wrote them."""
    LM: gl.constexpr = gl.BlockedLayout([1, HEAD_DIM // 32], [1, 32], [1, 1], [1, 0])
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LM))
    offs_p = gl.arange(0, P_CHUNK, layout=gl.SliceLayout(1, LM))
    m_run = float("-inf")
    total = 0.0
    acc = gl.zeros([HEAD_DIM], gl.float32, gl.SliceLayout(0, LM))
    for p0 in range(0, n_valid, P_CHUNK):
        offs_c = p0 + offs_p
        c_mask = offs_c < n_valid
        m = gl.load(part_m_ptr + base + offs_c, mask=c_mask, other=float("-inf"), cache_modifier=".cg")
        m_new = gl.maximum(m_run, gl.max(m, 0))
        alpha = gl.exp2(m_run - m_new)
        w = gl.where(c_mask, gl.exp2(m - m_new), 0.0)
        l = gl.load(part_l_ptr + base + offs_c, mask=c_mask, other=0.0, cache_modifier=".cg")
        o = gl.load(part_out_ptr + (base + offs_c)[:, None] * HEAD_DIM + offs_d[None, :], mask=c_mask[:, None],
                    other=0.0, cache_modifier=".cg")
        total = total * alpha + gl.sum(w * l, 0)
        acc = acc * alpha + gl.sum(w[:, None] * o, 0)
        m_run = m_new
    acc = acc / gl.where(total > 0, total, 1.0)
    gl.store(out_ptr + offs_d, acc.to(out_ptr.dtype.element_ty))


@gluon.jit
def _halves(x, S: gl.constexpr):
    """[lanes, S] -> its even and odd steps, [lanes, S / 2] each."""
    return gl.split(gl.reshape(x, [32, S // 2, 2]))


@gluon.jit
def _qk(ka0, ka1, ka2, ka3, qb0, qb1, S: gl.constexpr):
    """S^T of a chunk: the S k16 steps ([lanes, S] fragments) in two chains of S / 2 mmas, then summed."""
    ka0e, ka0o = _halves(ka0, S)
    ka1e, ka1o = _halves(ka1, S)
    ka2e, ka2o = _halves(ka2, S)
    ka3e, ka3o = _halves(ka3, S)
    qb0e, qb0o = _halves(qb0, S)
    qb1e, qb1o = _halves(qb1, S)
    if S == 8:
        a0, b0 = _halves(ka0e, 4)
        a1, b1 = _halves(ka1e, 4)
        a2, b2 = _halves(ka2e, 4)
        a3, b3 = _halves(ka3e, 4)
        q0, r0 = _halves(qb0e, 4)
        q1, r1 = _halves(qb1e, 4)
        zero = gl.zeros_like(a0).to(gl.float32)
        c0, c1, c2, c3 = _mma(a0, a1, a2, a3, q0, q1, zero, zero, zero, zero)
        c0, c1, c2, c3 = _mma(b0, b1, b2, b3, r0, r1, c0, c1, c2, c3)
        a0, b0 = _halves(ka0o, 4)
        a1, b1 = _halves(ka1o, 4)
        a2, b2 = _halves(ka2o, 4)
        a3, b3 = _halves(ka3o, 4)
        q0, r0 = _halves(qb0o, 4)
        q1, r1 = _halves(qb1o, 4)
        c0, c1, c2, c3 = _mma(a0, a1, a2, a3, q0, q1, c0, c1, c2, c3)
        c0, c1, c2, c3 = _mma(b0, b1, b2, b3, r0, r1, c0, c1, c2, c3)
    else:
        zero = gl.zeros_like(ka0e).to(gl.float32)
        c0, c1, c2, c3 = _mma(ka0e, ka1e, ka2e, ka3e, qb0e, qb1e, zero, zero, zero, zero)
        c0, c1, c2, c3 = _mma(ka0o, ka1o, ka2o, ka3o, qb0o, qb1o, c0, c1, c2, c3)
    return gl.sum(c0, 1), gl.sum(c1, 1), gl.sum(c2, 1), gl.sum(c3, 1)


@gluon.jit
def _pv(y_row_g, y_row_h, pb0, pb1, c0, c1, c2, c3, LW: gl.constexpr):
    """One m16 tile of O^T += V^T P^T: V^T rows g and g + 8 ([lanes, words, token pair])."""
    g0, g1 = gl.split(y_row_g)
    h0, h1 = gl.split(y_row_h)
    return _mma(gl.convert_layout(g0, LW, assert_trivial=True), gl.convert_layout(h0, LW, assert_trivial=True),
                gl.convert_layout(g1, LW, assert_trivial=True), gl.convert_layout(h1, LW, assert_trivial=True),
                pb0, pb1, c0, c1, c2, c3)


@gluon.jit
def _step(kw, vw, c, end, g, qb0, qb1, scale_log2, m0, m1, l0, l1, o00, o01, o02, o03, o10, o11, o12, o13,
          S: gl.constexpr, LL: gl.constexpr, LQ: gl.constexpr, LW: gl.constexpr, LWL: gl.constexpr):
    """One chunk (keys c .. c + 15; those at or past end masked) into the running softmax state: per head the
    reference max m, this lane's share of the sum l, and the accumulators o."""
    # S^T: lane (g, t) gets keys g (s0, s1) and g + 8 (s2, s3) of heads 2t (s0, s2) and 2t + 1 (s1, s3)
    lo, hi = _e4m3_pairs(kw)
    ka0, ka1 = gl.split(lo)
    ka2, ka3 = gl.split(hi)
    s0, s1, s2, s3 = _qk(gl.convert_layout(ka0, LQ, assert_trivial=True),
                         gl.convert_layout(ka1, LQ, assert_trivial=True),
                         gl.convert_layout(ka2, LQ, assert_trivial=True),
                         gl.convert_layout(ka3, LQ, assert_trivial=True), qb0, qb1, S)
    s0 = gl.convert_layout(s0, LL, assert_trivial=True)
    s1 = gl.convert_layout(s1, LL, assert_trivial=True)
    s2 = gl.convert_layout(s2, LL, assert_trivial=True)
    s3 = gl.convert_layout(s3, LL, assert_trivial=True)
    key_ok = c + g < end
    key8_ok = c + g + 8 < end
    s0 = gl.where(key_ok, s0 * scale_log2, float("-inf"))
    s1 = gl.where(key_ok, s1 * scale_log2, float("-inf"))
    s2 = gl.where(key8_ok, s2 * scale_log2, float("-inf"))
    s3 = gl.where(key8_ok, s3 * scale_log2, float("-inf"))
    # Lazy rescaling: the reference max moves (and the sums and accumulators with it) only when a score exceeds
    # it by more than RESCALE_LOG2 (scores are log2-scaled), a warp-uniform branch; until then p <= 2^8, which
    # fp16 holds, and 32 multiplies a chunk are saved.
    mx0 = _across_rows(gl.maximum(s0, s2), _COL_MAX)
    mx1 = _across_rows(gl.maximum(s1, s3), _COL_MAX)
    if gl.max(gl.maximum(mx0 - m0, mx1 - m1), 0) > RESCALE_LOG2:
        new0 = gl.maximum(m0, mx0)
        new1 = gl.maximum(m1, mx1)
        alpha0 = gl.exp2(m0 - new0)
        alpha1 = gl.exp2(m1 - new1)
        l0 = l0 * alpha0
        l1 = l1 * alpha1
        m0 = new0
        m1 = new1
        a0 = gl.expand_dims(gl.convert_layout(alpha0, LWL, assert_trivial=True), 1)
        a1 = gl.expand_dims(gl.convert_layout(alpha1, LWL, assert_trivial=True), 1)
        o00 = o00 * a0
        o01 = o01 * a1
        o02 = o02 * a0
        o03 = o03 * a1
        o10 = o10 * a0
        o11 = o11 * a1
        o12 = o12 * a0
        o13 = o13 * a1
    p0 = gl.exp2(s0 - m0)
    p1 = gl.exp2(s1 - m1)
    p2 = gl.exp2(s2 - m0)
    p3 = gl.exp2(s3 - m1)
    l0 = l0 + p0 + p2
    l1 = l1 + p1 + p3
    # P^T's B fragment (tokens 2t, 2t + 1 | 2t + 8, 2t + 9 of head g): S^T's rows transposed
    pb0 = gl.expand_dims(gl.convert_layout(_transpose(_f16x2(p0, p1)), LWL, assert_trivial=True), 1)
    pb1 = gl.expand_dims(gl.convert_layout(_transpose(_f16x2(p2, p3)), LWL, assert_trivial=True), 1)
    va, vb = gl.split(vw)
    y0, y1, y2, y3 = _e4m3_token_pairs(va, vb)  # [lanes, words, pair]: d = g D/8 + 4i + j for yj
    o00, o01, o02, o03 = _pv(y0, y1, pb0, pb1, o00, o01, o02, o03, LW)
    o10, o11, o12, o13 = _pv(y2, y3, pb0, pb1, o10, o11, o12, o13, LW)

    return m0, m1, l0, l1, o00, o01, o02, o03, o10, o11, o12, o13


# as triton_attention's decode kernel: one compile for any table width and batch size
@gluon.jit(do_not_specialize=("stride_bt", "table_cols", "num_parts", "target_log2"))
def _fp8_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, counter_ptr,
                       seq_lens_ptr, block_tables_ptr, scale_log2,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
                       table_cols, num_heads, num_kv_heads, num_parts, target_log2,
                       GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, FIXED: gl.constexpr,
                       MIN_PARTITION: gl.constexpr, MAX_PARTITION: gl.constexpr, P_CHUNK: gl.constexpr,
                       PDL: gl.constexpr):
    """One (sequence, KV head, partition), one warp. k_ptr / v_ptr: the caches as 32-bit words, strides in
    words."""
    S: gl.constexpr = HEAD_DIM // 16  # K words a lane a key: one a k16 step
    W: gl.constexpr = HEAD_DIM // 32  # V words a lane a token
    LK: gl.constexpr = gl.BlockedLayout([1, S, 2], [32, 1, 1], [1, 1, 1], [1, 2, 0])  # [lanes, steps, key g | g + 8]
    LQ: gl.constexpr = gl.SliceLayout(2, LK)  # [lanes, steps]
    LL: gl.constexpr = gl.SliceLayout(1, LQ)  # [lanes]
    # [lanes, words, tokens 2t | 2t + 8, + 0 | + 1]: V
    LV: gl.constexpr = gl.BlockedLayout([1, W, 2, 2], [32, 1, 1, 1], [1, 1, 1, 1], [1, 3, 2, 0])
    LW: gl.constexpr = gl.BlockedLayout([1, W], [32, 1], [1, 1], [1, 0])  # [lanes, words]: accumulators
    LWL: gl.constexpr = gl.SliceLayout(1, LW)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq = gl.program_id(0)
    kv_head = gl.program_id(1)
    part = gl.program_id(2)
    # a context longer than the grid's partitions of MAX_PARTITION (which cover its block table) is cut, so that
    # exactly n_parts programs arrive at the merge
    ctx = gl.minimum(gl.load(seq_lens_ptr + seq), num_parts * MAX_PARTITION)
    if FIXED:  # a batch that fills the GPU by itself: every partition MAX_PARTITION long
        length = MAX_PARTITION
    else:
        length = _partition_len(ctx, target_log2, MIN_PARTITION, MAX_PARTITION)
    start = part * length
    if (start >= ctx) & (part > 0):
        return  # the grid covers the longest context the table holds; this partition has nothing to read
    end = gl.minimum(start + length, ctx)
    n_parts = gl.cdiv(ctx, length)

    lane = gl.arange(0, 32, layout=LL)
    g = lane // 4
    t = lane % 4
    # Q^T's B fragment: lane (g, t) holds head g, d = t D/4 + 4s + e as qb0 (e = 0, 1) and qb1 (e = 2, 3) of step s
    step = gl.arange(0, S, layout=gl.SliceLayout(0, LQ))
    d_q = gl.expand_dims(t * (HEAD_DIM // 4), 1) + gl.expand_dims(step, 0) * 4
    q_row = gl.expand_dims(q_ptr + seq.to(gl.int64) * stride_qt + (kv_head * GROUP + g) * stride_qh, 1)
    q_ok = gl.expand_dims(g < GROUP, 1)
    q0 = gl.load(q_row + d_q, mask=q_ok, other=0.0).to(gl.float32)
    q1 = gl.load(q_row + d_q + 1, mask=q_ok, other=0.0).to(gl.float32)
    q2 = gl.load(q_row + d_q + 2, mask=q_ok, other=0.0).to(gl.float32)
    q3 = gl.load(q_row + d_q + 3, mask=q_ok, other=0.0).to(gl.float32)
    qb0 = _f16x2(q0, q1)
    qb1 = _f16x2(q2, q3)

    # K: lane (g, t) loads keys g and g + 8 of the chunk, words [t S, (t + 1) S) of their rows
    half = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LK))), 0), 1)
    k_tok = gl.expand_dims(gl.expand_dims(g, 1), 2) + half * 8
    k_word = gl.expand_dims(gl.expand_dims(t * S, 1) + gl.expand_dims(step, 0), 2)
    # V: lane (g, t) loads tokens 2t + 8p + m of the chunk, words [g W, (g + 1) W) of their rows
    SV3: gl.constexpr = gl.SliceLayout(3, LV)
    SV2: gl.constexpr = gl.SliceLayout(2, SV3)
    lane_v = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.convert_layout(lane, gl.SliceLayout(1, SV2), assert_trivial=True), 1), 2), 3)
    word_v = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(0, SV2)), 0), 2), 3)
    pair_v = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, SV3))), 0), 1), 3)
    member_v = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LV)))), 0), 1), 2)
    v_tok = lane_v % 4 * 2 + pair_v * 8 + member_v
    v_word = lane_v // 4 * W + word_v

    table = block_tables_ptr + seq.to(gl.int64) * stride_bt
    head_off = kv_head * stride_ch
    m0 = gl.full([32], float("-inf"), gl.float32, LL)  # the scores' reference max of head 2t (m1: 2t + 1)
    m1 = gl.full([32], float("-inf"), gl.float32, LL)
    l0 = gl.zeros([32], gl.float32, LL)  # this lane's share of the softmax sum of head 2t (l1: 2t + 1)
    l1 = gl.zeros([32], gl.float32, LL)
    o00 = gl.zeros([32, W], gl.float32, LW)  # o<h><r>: register r of m16 tile 2i + h, word i
    o01 = gl.zeros([32, W], gl.float32, LW)
    o02 = gl.zeros([32, W], gl.float32, LW)
    o03 = gl.zeros([32, W], gl.float32, LW)
    o10 = gl.zeros([32, W], gl.float32, LW)
    o11 = gl.zeros([32, W], gl.float32, LW)
    o12 = gl.zeros([32, W], gl.float32, LW)
    o13 = gl.zeros([32, W], gl.float32, LW)
    n_chunks = gl.maximum(end - start + CHUNK - 1, 0) // CHUNK
    state = (m0, m1, l0, l1, o00, o01, o02, o03, o10, o11, o12, o13)
    last = start + (n_chunks - 1) * CHUNK
    cur = _load_chunk(k_ptr, v_ptr, table, start, last, end, table_cols, k_word, k_tok, v_word, v_tok, stride_cb,
                      stride_ct, head_off, BLOCK_SIZE)
    # two chunks a trip, each loaded while the one before it is multiplied (a chunk past end is all masked and
    # adds nothing); the buffers alternate instead of being copied
    for i in range(0, n_chunks, 2):
        c = start + i * CHUNK
        nxt = _load_chunk(k_ptr, v_ptr, table, c + CHUNK, last, end, table_cols, k_word, k_tok, v_word, v_tok,
                          stride_cb, stride_ct, head_off, BLOCK_SIZE)
        state = _step(cur[0], cur[1], c, end, g, qb0, qb1, scale_log2, *state, S, LL, LQ, LW, LWL)
        cur = _load_chunk(k_ptr, v_ptr, table, c + 2 * CHUNK, last, end, table_cols, k_word, k_tok, v_word, v_tok,
                          stride_cb, stride_ct, head_off, BLOCK_SIZE)
        state = _step(nxt[0], nxt[1], c + CHUNK, end, g, qb0, qb1, scale_log2, *state, S, LL, LQ, LW, LWL)
    m0, m1, l0, l1, o00, o01, o02, o03, o10, o11, o12, o13 = state

    split = n_parts > 1
    lane_w = gl.arange(0, 32, layout=LWL)
    t_w = lane_w % 4
    # column e of lane (g, t): head 2t + e; row g of tile 2i + h: d = g D/8 + 4i + 2h (row g + 8: + 1)
    head0 = kv_head * GROUP + t_w * 2
    ok0 = gl.expand_dims(t_w * 2 < GROUP, 1)
    ok1 = gl.expand_dims(t_w * 2 + 1 < GROUP, 1)
    tot0 = gl.convert_layout(_across_rows(l0, _COL_SUM), LWL, assert_trivial=True)
    tot1 = gl.convert_layout(_across_rows(l1, _COL_SUM), LWL, assert_trivial=True)
    d = gl.expand_dims(lane_w // 4 * (HEAD_DIM // 8), 1) + gl.expand_dims(
        gl.arange(0, W, layout=gl.SliceLayout(0, LW)), 0) * 4
    out0 = gl.expand_dims(out_ptr + seq.to(gl.int64) * stride_ot + head0 * stride_oh, 1)
    out1 = out0 + stride_oh
    row0 = (seq * num_heads + head0).to(gl.int64) * num_parts + part
    row1 = row0 + num_parts
    part0 = gl.expand_dims(part_out_ptr + row0 * HEAD_DIM, 1)
    part1 = gl.expand_dims(part_out_ptr + row1 * HEAD_DIM, 1)
    if split:
        first = lane_w // 4 == 0
        gl.store(part_m_ptr + row0, gl.convert_layout(m0, LWL, assert_trivial=True), mask=first & (t_w * 2 < GROUP))
        gl.store(part_m_ptr + row1, gl.convert_layout(m1, LWL, assert_trivial=True), mask=first & (t_w * 2 + 1 < GROUP))
        gl.store(part_l_ptr + row0, tot0, mask=first & (t_w * 2 < GROUP))
        gl.store(part_l_ptr + row1, tot1, mask=first & (t_w * 2 + 1 < GROUP))
    tot0 = gl.expand_dims(tot0, 1)
    tot1 = gl.expand_dims(tot1, 1)
    _store_cols(o00, d, ok0, out0, part0, tot0, split)
    _store_cols(o01, d, ok1, out1, part1, tot1, split)
    _store_cols(o02, d + 1, ok0, out0, part0, tot0, split)
    _store_cols(o03, d + 1, ok1, out1, part1, tot1, split)
    _store_cols(o10, d + 2, ok0, out0, part0, tot0, split)
    _store_cols(o11, d + 2, ok1, out1, part1, tot1, split)
    _store_cols(o12, d + 3, ok0, out0, part0, tot0, split)
    _store_cols(o13, d + 3, ok1, out1, part1, tot1, split)
    if split:
        if _arrive_last(counter_ptr + seq * num_kv_heads + kv_head, n_parts):
            for hg in gl.static_range(GROUP):
                head = kv_head * GROUP + hg
                _merge(part_out_ptr, part_m_ptr, part_l_ptr,
                       out_ptr + seq.to(gl.int64) * stride_ot + head * stride_oh,
                       (seq * num_heads + head).to(gl.int64) * num_parts, n_parts, HEAD_DIM, P_CHUNK)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether fp8_decode takes this decode call: e4m3 caches of one layout on an sm_89+ NVIDIA GPU (e4m3
    conversions), bf16 or fp16 queries, head dim 64 or 128, at most 8 query heads a KV head, blocks of a multiple
    of 16 tokens (a chunk lies in one block), and 16-byte aligned cache rows (each lane's words of a row are one
    or two 16-byte loads)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    return (k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn and k_cache.stride() == v_cache.stride()
            and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and torch.version.hip is None
            and torch.cuda.get_device_capability(q.device) >= (8, 9) and head_dim in HEAD_DIMS
            and k_cache.shape[3] == head_dim and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP and block_size % CHUNK_TOKENS == 0 and q.stride(-1) == 1
            and k_cache.stride(-1) == 1 and all(s % 16 == 0 for s in k_cache.stride()[:-1])
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0)


def fp8_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
               block_tables: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """triton_attention's decode (one query a sequence) for an e4m3 cache that supports() accepts: a grid from
    static shapes only (graph-capturable), partition lengths per sequence (triton_split.py), merged in the same
    launch."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_parts, target_log2 = triton_split.plan(num_seqs, num_kv_heads, block_tables.shape[1] * block_size,
                                               FP8_DECODE_CFG, num_sms(q.device.index or 0))
    if num_parts == 1:
        part_out = part_m = part_l = out  # never touched: no context is longer than one partition
        counter = seq_lens
    else:
        part_out = torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        counter = counters(q.device, num_seqs * num_kv_heads)
    k_words, v_words = k_cache.view(torch.int32), v_cache.view(torch.int32)
    _fp8_decode_kernel[(num_seqs, num_kv_heads, num_parts)](
        q, k_words, v_words, out, part_out, part_m, part_l, counter, seq_lens, block_tables, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_words.stride(0), k_words.stride(1),
        k_words.stride(2), block_tables.stride(0), block_tables.shape[1], num_heads, num_kv_heads, num_parts,
        target_log2, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        FIXED=target_log2 == 0, MIN_PARTITION=FP8_DECODE_CFG["min_partition"],
        MAX_PARTITION=FP8_DECODE_CFG["max_partition"], P_CHUNK=16, num_warps=1, **pdl_args(q))
