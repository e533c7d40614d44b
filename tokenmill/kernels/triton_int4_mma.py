"""INT4 decode matmul on tensor cores, in Gluon (Triton's explicit-layout dialect): y = x @ W.T (+ bias, + a
residual) for 1 to 16 rows of bf16 x and W packed INT4 (tokenmill/quant/formats.py), read in the layout it is
stored in.

Why: from 2 to 16 rows the 16-row tile kernel (triton_quant.py) wastes most of each dot and moves every
dequantized weight through shared memory into the dot's layout; here one `mma.sync.m16n8k16` multiplies 256
weights, straight from the registers they were loaded into, by up to 8 rows of x (the 8 columns of B; rows
past M are never stored; 9 to 16 rows take a second column tile, the same A fragment times a second B), and a
weight costs about two SASS instructions (one shift and one LOP3 turn it into a bf16 operand), against ~3.6
in the CUDA-core GEMV (triton_gemv.py, "unit"). H200, Llama-3-8B layer, INT4 g128: 72 to 76 us at 2 to 8 rows
against 130 to 156, 109 to 113 at 12 and 16 rows against 163 to 170 (docs/BENCHMARKS.md). At one row it wins
only on wide and deep matrices: like the GEMV it reaches about half of copy bandwidth, with a few warps a
multiprocessor each holding one span in flight (Nsight Compute).

A weight becomes a bf16 with its nibble in the mantissa, no conversion: a low nibble q under 128's exponent is
exactly 128 + q, a high nibble shifted to bits 3-6 under 16's exponent is exactly 16 + q. The tensor cores
sum (128 + q) x over low-nibble inputs and (16 + q) x over high ones in fp32; a second mma with constant
operands gives, for the same x, both 128 sum(x_low) + 16 sum(x_high) (taken off) and sum(x) (times the group's
min). Each span of inputs is one group, so a group's scale and min apply once to its sums.

Every thread's registers are written out by hand, the way mma.sync wants them. Lane l of a warp (g = l // 4,
t = l % 4) holds rows g and g + 8 of each 16-row tile and reads, per row and span, words [t WPT, (t + 1) WPT)
of the span's packed bytes (WPT = group / 32 32-bit words, one 16-byte load at group 128). Byte i of a 32-input
packing block holds input i (low nibble) and i + 16 (high nibble), so a word's bytes 0 and 2 give the A pairs
of one k16 step (inputs k, k + 2 and k + 16, k + 18) and bytes 1 and 3 those of the next. The inputs each
thread covers are the same for A and B, which is all an mma needs: x is loaded at those inputs and paired by
byte permutes. All tensors have the layout [threads, tiles, words]: thread first, one thread a row."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenmill.kernels.triton_arrive import arrive_last, counters
from tokenmill.kernels.triton_gemv import WIDE_N, num_sms
from tokenmill.kernels.triton_pdl import pdl_args

_arrive_last = gluon.jit(arrive_last.fn)  # triton_arrive.py's merge protocol, compiled as Gluon

MAX_ROWS = 16  # two column tiles: the n of m16n8k16 is 8, x's rows are the columns of B


@dataclass(frozen=True)
class MmaGemvConfig:
    tiles: int = 2  # 16-row tiles a warp holds
    num_warps: int = 4
    programs_per_sm: int = 4
    # split_k 0: split K until there are about programs_per_sm programs per multiprocessor (a TMA ring: at most
    # that many, so a split grid runs in one wave where programs_per_sm is the ring kernel's residency)
    split_k: int = 0
    stages: int = 0  # spans of weights in flight in a TMA ring in shared memory (sm_90+); 0: loads to registers
    # a TMA ring whose grid is resident at once (one wave; Llama-3-8B's gate/up: 448 programs that fit 7 a
    # multiprocessor by registers) releases the next kernel right after its PDL wait, not after its loop: no
    # program of its own is left to launch, so the next kernel's take only the room these leave (TMA rings only)
    release_early: bool = False

    @property
    def block_n(self) -> int:
        return 16 * self.tiles * self.num_warps


# Tuned on the H200 (docs/BENCHMARKS.md), INT4 g128 on Llama-3-8B's four projections, last in place in one engine
# (the step's time, not each kernel's alone). 2 to 16 rows: one config for all of them, so a row's result never
# depends on how many others there are; 3 programs a multiprocessor since the split merge was unrolled (batch 8
# 3078.9 tokens/s against 2994.2 at 2; batch 2 and 4 +3.6% and +3.1%). One row, where the GPU has TMA, two-warp
# programs fed by a ring in shared memory, two spans a step: gate/up (WIDE_N rows or more) in one wave at 3 programs
# a multiprocessor and 4 stages; down (deep: K at least twice N) on 2 stages, split into as many programs as fit one
# wave at 6 a multiprocessor (the residency of its programs when they took 154 registers, now 138: 12 splits of
# Llama-3-8B's down on 132 multiprocessors, 768 programs, against 9 at the earlier 4; 2 more splits made a second
# wave), its first copies issued before the PDL wait while gate/up finishes; qkv (tall: more rows than inputs) at 6
# and 2 stages (batch 1 500.1 against 493.9 for both on the GEMV's and the 3-stage ring's earlier choices); a
# vocabulary-sized LM head (VOCAB_N rows or more: many waves, so no split and programs of one tile a warp, 79% of
# copy against 66-70% at two; H100, down and LM head together 455.4 tokens/s against 451.5). o (square) stays on the
# CUDA-core GEMV (triton_gemv.py): on a ring it lost (486.6). The one-wave rings (all but the LM head's) release
# the next kernel right after their wait: its programs are resident, their first copies issued, when the last of
# the ring's ends (down began 1.0 us after gate/up's last program; H100, batch 1 475.5 tokens/s against 465.6).
# Without TMA, wide and deep matrices take the register-fed kernel below (gate/up 28.3 us against the GEMV's 32.4,
# down 16.3 against 17.2); anything smaller than 2^24 weights stays on the GEMV.
MMA_CFG = MmaGemvConfig(tiles=2, num_warps=4, programs_per_sm=3)
ROW_WIDE_CFG = MmaGemvConfig(tiles=4, num_warps=4, programs_per_sm=1)
ROW_WIDE_TMA_CFG = MmaGemvConfig(tiles=2, num_warps=2, programs_per_sm=3, stages=4, release_early=True)
ROW_DEEP_CFG = MmaGemvConfig(tiles=4, num_warps=4, programs_per_sm=2)
ROW_DEEP_TMA_CFG = MmaGemvConfig(tiles=2, num_warps=2, programs_per_sm=6, stages=2, release_early=True)
ROW_TALL_TMA_CFG = MmaGemvConfig(tiles=2, num_warps=2, programs_per_sm=6, stages=2, release_early=True)
ROW_VOCAB_TMA_CFG = MmaGemvConfig(tiles=1, num_warps=2, programs_per_sm=3, stages=4)
VOCAB_N = 65536  # rows from which one row of a matrix (an LM head) runs in many waves


def default_config(m: int, n: int, k: int, tma: bool = False) -> MmaGemvConfig | None:
    """The tuned config for m rows of x and an [n, k] weight (tma: the weight can be read by TMA, has_tma());
    None where one row runs faster on the GEMV."""
    if m > 1:
        return MMA_CFG
    if n * k < 1 << 24:
        return None
    if n >= WIDE_N:
        if tma:
            return ROW_VOCAB_TMA_CFG if n >= VOCAB_N else ROW_WIDE_TMA_CFG
        return ROW_WIDE_CFG
    if k < 2 * n:
        return ROW_TALL_TMA_CFG if tma and n > k else None
    return ROW_DEEP_TMA_CFG if tma else ROW_DEEP_CFG


@gluon.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A B + C for each thread's fragments (bf16 A and B pairs in 32-bit words, fp32 C and D)."""
    return gl.inline_asm_elementwise(
        asm="mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
            "{$10,$11,$12,$13};",
        constraints="=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(gl.float32,) * 4, is_pure=True, pack=1)


@gluon.jit
def _mma_first(a0, a1, a2, a3, b0, b1):
    """D = A B (C = 0)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .f32 z;
        mov.f32 z, 0f00000000;
        mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {z,z,z,z};
        }""",
        constraints="=f,=f,=f,=f,r,r,r,r,r,r", args=[a0, a1, a2, a3, b0, b1], dtype=(gl.float32,) * 4,
        is_pure=True, pack=1)


@gluon.jit
def _mma_offsets(ba0, ba1, bb0, bb1):
    """The mma of x with constant A over both k16 steps of a word (B pairs ba and bb): rows g take 128 at
    low-nibble inputs and 16 at high ones (the offsets the magic numbers add: D's c0 and c1), rows g + 8 take 1
    everywhere (the sums of x: c2 and c3)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a0, a1, a2;
        .reg .f32 z;
        mov.b32 a0, 0x43004300;
        mov.b32 a1, 0x3F803F80;
        mov.b32 a2, 0x41804180;
        mov.f32 z, 0f00000000;
        mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {a0,a1,a2,a1}, {$4,$5}, {z,z,z,z};
        mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {a0,a1,a2,a1}, {$6,$7}, {$0,$1,$2,$3};
        }""",
        constraints="=f,=f,=f,=f,r,r,r,r", args=[ba0, ba1, bb0, bb1], dtype=(gl.float32,) * 4,
        is_pure=True, pack=1)


@gluon.jit
def _weights_even(w):
    """Bytes 0 and 2 of packed words as A pairs: (128 + q) from the low nibbles, (16 + q) from the high ones."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 s;
        shr.u32 s, $2, 1;
        lop3.b32 $0, $2, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $1, s, 0x00780078, 0x41804180, 0xEA;
        }""",
        constraints="=r,=r,r", args=[w], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _weights_odd(w):
    """Bytes 1 and 3 of packed words as A pairs (see _weights_even)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 s, u;
        shr.u32 s, $2, 8;
        shr.u32 u, $2, 9;
        lop3.b32 $0, s, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $1, u, 0x00780078, 0x41804180, 0xEA;
        }""",
        constraints="=r,=r,r", args=[w], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _pairs(even, odd):
    """From words (x[i], x[i + 1]) and (x[i + 2], x[i + 3]): the B pairs (x[i], x[i + 2]) and (x[i + 1], x[i + 3])."""
    return gl.inline_asm_elementwise(
        asm="prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;",
        constraints="=r,=r,r,r", args=[even, odd], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _load_side(s_rows_g, s_rows_h, m_rows_g, m_rows_h, x_run, xw_k, ks, K, GROUP: gl.constexpr,
               EVEN_K: gl.constexpr):
    """The scales and mins of rows g and g + 8 and this thread's x words (its low-nibble inputs and the
    high-nibble ones 16 further, for each column tile) for the span (one group) at input ks. Batch rows past M
    were clamped to the last one: their results are never stored. Without EVEN_K, x words (xw_k: their first
    inputs in the span) past K read as zeros, so whatever weights lie there add nothing."""
    grp = ks // GROUP
    sg = gl.load(s_rows_g + grp).to(gl.float32)
    sh = gl.load(s_rows_h + grp).to(gl.float32)
    mg = gl.load(m_rows_g + grp).to(gl.float32)
    mh = gl.load(m_rows_h + grp).to(gl.float32)
    x_lo_ptr = x_run + ks // 2
    if EVEN_K:
        x_lo = gl.load(x_lo_ptr)
        x_hi = gl.load(x_lo_ptr + 8)
    else:
        x_lo = gl.load(x_lo_ptr, mask=ks + xw_k < K, other=0)
        x_hi = gl.load(x_lo_ptr + 8, mask=ks + xw_k + 16 < K, other=0)
    return sg, sh, mg, mh, x_lo, x_hi


@gluon.jit
def _load_span(w_rows_g, w_rows_h, s_rows_g, s_rows_h, m_rows_g, m_rows_h, x_run, blk_k, xw_k, ks, K,
               GROUP: gl.constexpr, EVEN_K: gl.constexpr):
    """_load_side and the packed words of rows g and g + 8 for the span at input ks (rows past N were clamped
    to the last one). Without EVEN_K, packing blocks (blk_k: a block's first input in the span) past K read as
    zeros."""
    span_w = gl.multiple_of(ks // 8, GROUP // 8)
    if EVEN_K:
        wg = gl.load(w_rows_g + span_w)
        wh = gl.load(w_rows_h + span_w)
    else:
        wg = gl.load(w_rows_g + span_w, mask=ks + blk_k < K, other=0)
        wh = gl.load(w_rows_h + span_w, mask=ks + blk_k < K, other=0)
    return (wg, wh) + _load_side(s_rows_g, s_rows_h, m_rows_g, m_rows_h, x_run, xw_k, ks, K, GROUP, EVEN_K)


@gluon.jit
def _b_pairs(x_words, LB: gl.constexpr):
    """[threads, column tiles, 2 WPT] x words -> the B pairs of the even and odd k16 steps of each word,
    [threads, 1, column tiles, WPT]."""
    even, odd = gl.split(gl.reshape(x_words, [x_words.shape[0], x_words.shape[1], x_words.shape[2] // 2, 2]))
    ba, bb = _pairs(gl.convert_layout(even, LB), gl.convert_layout(odd, LB))
    return gl.expand_dims(ba, 1), gl.expand_dims(bb, 1)


@gluon.jit
def _a_fragment(wg, wh, ODD: gl.constexpr):
    """The A registers of rows g and g + 8 for the even (bytes 0 and 2) or odd (bytes 1 and 3) k16 step of each
    word, in mma order (row g low nibbles, row g + 8 low, row g high, row g + 8 high), [threads, tiles, 1, words]."""
    if ODD:
        lo_g, hi_g = _weights_odd(wg)
        lo_h, hi_h = _weights_odd(wh)
    else:
        lo_g, hi_g = _weights_even(wg)
        lo_h, hi_h = _weights_even(wh)
    return gl.expand_dims(lo_g, 2), gl.expand_dims(lo_h, 2), gl.expand_dims(hi_g, 2), gl.expand_dims(hi_h, 2)


@gluon.jit
def _span_mma(span, p0, p1, p2, p3, LB: gl.constexpr, PAIR: gl.constexpr):
    """One span (_load_span) times x, added to the fragment registers p0..p3 ([threads, tiles, column tiles]:
    rows g, g + 8 by batch columns col, col + 1 of each column tile)."""
    wg, wh, sg, sh, mg, mh, x_lo, x_hi = span
    ba_lo, bb_lo = _b_pairs(x_lo, LB)
    ba_hi, bb_hi = _b_pairs(x_hi, LB)
    o0, o1, z0, z1 = _mma_offsets(ba_lo, ba_hi, bb_lo, bb_hi)
    a0, a1, a2, a3 = _a_fragment(wg, wh, False)
    c0, c1, c2, c3 = _mma_first(a0, a1, a2, a3, ba_lo, ba_hi)
    a0, a1, a2, a3 = _a_fragment(wg, wh, True)
    c0, c1, c2, c3 = _mma(a0, a1, a2, a3, bb_lo, bb_hi, c0, c1, c2, c3)
    sg = gl.expand_dims(sg, 2)
    sh = gl.expand_dims(sh, 2)
    mg = gl.expand_dims(mg, 2)
    mh = gl.expand_dims(mh, 2)
    o0 = gl.sum(o0, 3)
    z0 = gl.sum(z0, 3)
    p0 += sg * (gl.sum(c0, 3) - o0) + mg * z0
    p2 += sh * (gl.sum(c2, 3) - o0) + mh * z0
    if PAIR:
        o1 = gl.sum(o1, 3)
        z1 = gl.sum(z1, 3)
        p1 += sg * (gl.sum(c1, 3) - o1) + mg * z1
        p3 += sh * (gl.sum(c3, 3) - o1) + mh * z1
    return p0, p1, p2, p3


@gluon.jit
def _store_rows(val, rows, col, row_ok, b_ptr, r_ptr, out_ptr, part_ptr, M, N,
                HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, PARTIAL: gl.constexpr):
    """One fragment register ([threads, tiles, column tiles]: rows, batch columns col) to out, or to this
    split's partials."""
    ok = row_ok & (col < M)
    if PARTIAL:
        gl.store(part_ptr + (gl.program_id(1) * M + col) * N + rows, val, mask=ok)
    else:
        if HAS_BIAS:
            val += gl.load(b_ptr + rows, mask=ok, other=0.0).to(gl.float32)
        if HAS_RESIDUAL:
            val += gl.load(r_ptr + col * N + rows, mask=ok, other=0.0).to(gl.float32)
        gl.store(out_ptr + col * N + rows, val.to(out_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def _store_gated(g, u, rows_g, rows_h, col, ok, b_ptr, out_ptr, M, HALF, HAS_BIAS: gl.constexpr):
    """silu(gate) * up of one fragment register pair (gate rows_g, up rows_h = HALF + rows_g) to out [M, HALF],
    computed as the SiLU·mul kernel (triton_activation.py) computes it from the product's output: gate and up
    rounded to out's dtype first, so the fused store writes the very values of the two kernels."""
    if HAS_BIAS:
        g += gl.load(b_ptr + rows_g, mask=ok, other=0.0).to(gl.float32)
        u += gl.load(b_ptr + rows_h, mask=ok, other=0.0).to(gl.float32)
    g = g.to(out_ptr.dtype.element_ty).to(gl.float32)
    u = u.to(out_ptr.dtype.element_ty).to(gl.float32)
    h = g * (1 / (1 + gl.exp(-g))) * u
    gl.store(out_ptr + col * HALF + rows_g, h.to(out_ptr.dtype.element_ty), mask=ok & (col < M))


@gluon.jit
def _merged(val, rows, col, row_ok, part_ptr, M, N, SPLITS: gl.constexpr):
    """The sum of every split's partials of one fragment register, in split order. Unrolled, so every load is
    in flight at once; a loop waited one L2 round trip a split (down alone, 7 splits: 16.5 us against 17.9, H100)."""
    ok = row_ok & (col < M)
    total = gl.zeros_like(val)
    for s in gl.static_range(SPLITS):
        total += gl.load(part_ptr + (s * M + col) * N + rows, mask=ok, other=0.0, cache_modifier=".cg")
    return total


@gluon.jit
def _row_params(rows_g, rows_h, s_ptr, m_ptr, N, stride_sn):
    """The rows a thread loads (rows past N read the last row, never stored: no masks in the loop) and pointers to
    their scales and mins."""
    load_g = gl.minimum(rows_g, N - 1).to(gl.int64)
    load_h = gl.minimum(rows_h, N - 1).to(gl.int64)
    return (load_g, load_h, s_ptr + load_g * stride_sn, s_ptr + load_h * stride_sn, m_ptr + load_g * stride_sn,
            m_ptr + load_h * stride_sn)


@gluon.jit
def _x_words(x_ptr, M, stride_x, T: gl.constexpr, COLS: gl.constexpr, WPT: gl.constexpr, LX: gl.constexpr):
    """Pointers to this thread's x words of a span at input 0 ([threads, column tiles, 2 WPT]: batch row g + 8 c
    of the lane in column tile c; past M the last row, never stored), and each word's first input in a span.
    Byte 4 t WPT of a span is the thread's first; byte b holds input 32 (b // 16) + b % 16 in its low nibble, so
    the thread's low-nibble inputs are a run of 4 WPT from there (2 WPT words) and its high-nibble inputs the
    run 16 further."""
    tid_x = gl.arange(0, T, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))
    lane_x = tid_x % 32
    byte0 = lane_x % 4 * (4 * WPT)
    x_word0 = gl.multiple_of(byte0 // 16 * 16 + byte0 % 16 // 2, 2 * WPT)
    xw = x_word0[:, None, None] + gl.expand_dims(gl.expand_dims(
        gl.arange(0, 2 * WPT, layout=gl.SliceLayout(0, gl.SliceLayout(0, LX))), 0), 0)
    x_col = gl.arange(0, COLS, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))
    x_batch = gl.minimum((lane_x // 4)[:, None] + x_col[None, :] * 8, M - 1).to(gl.int64)
    return x_ptr + gl.expand_dims(x_batch * stride_x, 2) + xw, xw * 2


@gluon.jit
def _store_all(p0, p1, p2, p3, rows_g, rows_h, col, row_ok_g, row_ok_h, b_ptr, r_ptr, out_ptr, part_ptr, M, N,
               HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, PAIR: gl.constexpr, PARTIAL: gl.constexpr):
    """_store_rows of every fragment register: rows g (p0, p1) and g + 8 (p2, p3), batch columns col (p0, p2) and
    col + 1 (p1, p3, with PAIR)."""
    _store_rows(p0, rows_g, col, row_ok_g, b_ptr, r_ptr, out_ptr, part_ptr, M, N, HAS_BIAS, HAS_RESIDUAL, PARTIAL)
    _store_rows(p2, rows_h, col, row_ok_h, b_ptr, r_ptr, out_ptr, part_ptr, M, N, HAS_BIAS, HAS_RESIDUAL, PARTIAL)
    if PAIR:
        _store_rows(p1, rows_g, col + 1, row_ok_g, b_ptr, r_ptr, out_ptr, part_ptr, M, N, HAS_BIAS, HAS_RESIDUAL,
                    PARTIAL)
        _store_rows(p3, rows_h, col + 1, row_ok_h, b_ptr, r_ptr, out_ptr, part_ptr, M, N, HAS_BIAS, HAS_RESIDUAL,
                    PARTIAL)


@gluon.jit
def _store_final(p0, p1, p2, p3, rows_g, rows_h, col, row_ok_g, row_ok_h, b_ptr, r_ptr, out_ptr, part_ptr, M, N,
                 HALF, HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, PAIR: gl.constexpr,
                 GATED: gl.constexpr):
    """The results of rows g (p0, p1) and g + 8 (p2, p3) to out; GATED: silu(gate) * up of the pairs."""
    if GATED:
        _store_gated(p0, p2, rows_g, rows_h, col, row_ok_g, b_ptr, out_ptr, M, HALF, HAS_BIAS)
        if PAIR:
            _store_gated(p1, p3, rows_g, rows_h, col + 1, row_ok_g, b_ptr, out_ptr, M, HALF, HAS_BIAS)
    else:
        _store_all(p0, p1, p2, p3, rows_g, rows_h, col, row_ok_g, row_ok_h, b_ptr, r_ptr, out_ptr, part_ptr, M, N,
                   HAS_BIAS, HAS_RESIDUAL, PAIR, False)


@gluon.jit
def _finish(p0, p1, p2, p3, rows_g, rows_h, lane, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr, M, N, HALF,
            HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, SPLITS: gl.constexpr, COLS: gl.constexpr,
            PAIR: gl.constexpr, GATED: gl.constexpr, LP: gl.constexpr):
    """Store the fragment registers (rows g: p0, p1; rows g + 8: p2, p3), or this split's partials; the last
    split to arrive adds all partials in split order. GATED: rows g are gate rows (below HALF), rows g + 8 the
    up rows of the same outputs."""
    # fragment registers c0 and c2 hold batch column col, c1 and c3 col + 1, of column tile c
    col = gl.expand_dims((lane % 4 * 2)[:, None], 2)
    col = col + gl.expand_dims(gl.expand_dims(gl.arange(0, COLS, layout=gl.SliceLayout(0, gl.SliceLayout(0, LP))),
                                              0), 0) * 8
    rows_g = gl.expand_dims(rows_g, 2)
    rows_h = gl.expand_dims(rows_h, 2)
    if GATED:
        row_ok_g = rows_g < HALF
        row_ok_h = row_ok_g
    else:
        row_ok_g = rows_g < N
        row_ok_h = rows_h < N
    if SPLITS > 1:
        _store_all(p0, p1, p2, p3, rows_g, rows_h, col, row_ok_g, row_ok_h, b_ptr, r_ptr, out_ptr, part_ptr, M, N,
                   HAS_BIAS, HAS_RESIDUAL, PAIR, True)
        if _arrive_last(counter_ptr + gl.program_id(0), SPLITS):
            p0 = _merged(p0, rows_g, col, row_ok_g, part_ptr, M, N, SPLITS)
            p2 = _merged(p2, rows_h, col, row_ok_h, part_ptr, M, N, SPLITS)
            if PAIR:
                p1 = _merged(p1, rows_g, col + 1, row_ok_g, part_ptr, M, N, SPLITS)
                p3 = _merged(p3, rows_h, col + 1, row_ok_h, part_ptr, M, N, SPLITS)
            _store_final(p0, p1, p2, p3, rows_g, rows_h, col, row_ok_g, row_ok_h, b_ptr, r_ptr, out_ptr, part_ptr,
                         M, N, HALF, HAS_BIAS, HAS_RESIDUAL, PAIR, GATED)
    else:
        _store_final(p0, p1, p2, p3, rows_g, rows_h, col, row_ok_g, row_ok_h, b_ptr, r_ptr, out_ptr, part_ptr, M, N,
                     HALF, HAS_BIAS, HAS_RESIDUAL, PAIR, GATED)


@gluon.jit
def _int4_mma_kernel(x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr, M, N, K,
                     k_per_split, stride_w, stride_x, stride_sn, HALF,
                     GROUP: gl.constexpr, EVEN_K: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
                     SPLITS: gl.constexpr, TILES: gl.constexpr, COLS: gl.constexpr, WARPS: gl.constexpr,
                     PAIR: gl.constexpr, GATED: gl.constexpr, PDL: gl.constexpr):
    """x_ptr: x as 32-bit words (bf16 pairs), stride_x words a row; w_ptr: the packed weight as 32-bit words,
    stride_w a row. Program (i, j): rows [i BLOCK_N, (i + 1) BLOCK_N), inputs [j k_per_split, (j + 1) k_per_split),
    batch rows in COLS column tiles of 8 (each A fragment is multiplied by each). Weights are loaded into
    registers one span ahead. GATED (W = cat(gate, up), HALF rows each): program i takes gate rows
    [i BLOCK_N / 2, (i + 1) BLOCK_N / 2) as each 16-row tile's rows g and the up rows HALF further as its rows
    g + 8, so a thread holds both halves of its outputs."""
    WPT: gl.constexpr = GROUP // 32
    L4: gl.constexpr = gl.BlockedLayout([1, TILES, COLS, WPT], [32, 1, 1, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
    LA: gl.constexpr = gl.SliceLayout(2, L4)  # [threads, tiles, words]: A
    LB: gl.constexpr = gl.SliceLayout(1, L4)  # [threads, column tiles, words]: B
    LP: gl.constexpr = gl.SliceLayout(3, L4)  # [threads, tiles, column tiles]: results
    LS: gl.constexpr = gl.SliceLayout(2, LP)  # [threads, tiles]: rows, scales
    LSA: gl.constexpr = gl.SliceLayout(2, LA)  # the same, as A's
    LX: gl.constexpr = gl.BlockedLayout([1, COLS, 2 * WPT], [32, 1, 1], [WARPS, 1, 1], [2, 1, 0])  # x words
    T: gl.constexpr = 32 * WARPS
    BLOCK_N: gl.constexpr = 16 * TILES * WARPS

    tid = gl.arange(0, T, layout=gl.SliceLayout(1, LS))
    lane = tid % 32
    tile = gl.arange(0, TILES, layout=gl.SliceLayout(0, LS))
    if GATED:
        rows_g = (gl.program_id(0) * (BLOCK_N // 2) + tid // 32 * (8 * TILES) + lane // 4)[:, None] + tile[None, :] * 8
        rows_h = rows_g + HALF
    else:
        rows_g = (gl.program_id(0) * BLOCK_N + tid // 32 * (16 * TILES) + lane // 4)[:, None] + tile[None, :] * 16
        rows_h = rows_g + 8
    load_g, load_h, s_rows_g, s_rows_h, m_rows_g, m_rows_h = _row_params(rows_g, rows_h, s_ptr, m_ptr, N, stride_sn)
    # this thread's words of a row: [t WPT, (t + 1) WPT) of each span's
    word = gl.arange(0, WPT, layout=gl.SliceLayout(0, gl.SliceLayout(0, LA)))
    lane_a = gl.convert_layout(lane, gl.SliceLayout(1, LSA))
    word_t = (lane_a % 4 * WPT)[:, None, None] + gl.expand_dims(gl.expand_dims(word, 0), 0)
    w_rows_g = w_ptr + gl.expand_dims(gl.convert_layout(load_g * stride_w, LSA), 2) + word_t
    w_rows_h = w_ptr + gl.expand_dims(gl.convert_layout(load_h * stride_w, LSA), 2) + word_t
    blk_k = (lane_a % 4 * WPT // 4 * 32)[:, None, None]  # the first input of the words' packing block (4 words)
    x_run, xw_k = _x_words(x_ptr, M, stride_x, T, COLS, WPT, LX)

    k_lo = gl.program_id(1) * k_per_split
    k_end = gl.minimum(k_lo + k_per_split, K)
    p0 = gl.zeros([T, TILES, COLS], gl.float32, LP)
    p1 = gl.zeros([T, TILES, COLS], gl.float32, LP)
    p2 = gl.zeros([T, TILES, COLS], gl.float32, LP)
    p3 = gl.zeros([T, TILES, COLS], gl.float32, LP)
    last = k_lo + (k_end - k_lo - 1) // GROUP * GROUP  # the last span: the load after it reloads it
    if PDL:
        gdc_wait()
    nxt = _load_span(w_rows_g, w_rows_h, s_rows_g, s_rows_h, m_rows_g, m_rows_h, x_run, blk_k, xw_k, k_lo, K,
                     GROUP, EVEN_K)
    for ks in range(k_lo, k_end, GROUP):  # one span in flight while the one before is multiplied
        span = nxt
        nxt = _load_span(w_rows_g, w_rows_h, s_rows_g, s_rows_h, m_rows_g, m_rows_h, x_run, blk_k, xw_k,
                         gl.minimum(ks + GROUP, last), K, GROUP, EVEN_K)
        p0, p1, p2, p3 = _span_mma(span, p0, p1, p2, p3, LB, PAIR)
    if PDL:
        gdc_launch_dependents()
    _finish(p0, p1, p2, p3, rows_g, rows_h, lane, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr, M, N, HALF,
            HAS_BIAS, HAS_RESIDUAL, SPLITS, COLS, PAIR, GATED, LP)


@gluon.jit
def _ring_copy(w_desc, ring, bars, stage, span, row0, row_h, col0, pred, SPAN_WORDS: gl.constexpr,
               BLOCK_N: gl.constexpr, GATED: gl.constexpr):
    """Copy a span's packed words into a stage of the TMA ring: rows [row0, row0 + BLOCK_N), or GATED, the gate
    rows from row0 into the stage's first half and the up rows from row_h into its second."""
    mbarrier.expect(bars.index(stage), BLOCK_N * SPAN_WORDS * 4, pred=pred)
    col = col0 + span * SPAN_WORDS
    if GATED:
        tma.async_copy_global_to_shared(w_desc, [row0, col], bars.index(stage),
                                        ring.index(stage).slice(0, BLOCK_N // 2), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [row_h, col], bars.index(stage),
                                        ring.index(stage).slice(BLOCK_N // 2, BLOCK_N // 2), pred=pred)
    else:
        tma.async_copy_global_to_shared(w_desc, [row0, col], bars.index(stage), ring.index(stage), pred=pred)


@gluon.jit
def _ring_span(w_desc, ring, bars, i, n_spans, row0, row_h, col0, T: gl.constexpr, TILES: gl.constexpr,
               WPT: gl.constexpr, STAGES: gl.constexpr, SPAN_WORDS: gl.constexpr, BLOCK_N: gl.constexpr,
               LA: gl.constexpr, FLAT: gl.constexpr, GATED: gl.constexpr):
    """Span i's packed words of rows g and g + 8 from its stage of the TMA ring, which is then refilled with span
    i + STAGES (where there is one)."""
    stage = i % STAGES
    mbarrier.wait(bars.index(stage), i // STAGES % 2)
    words = ring.index(stage)
    wg = words.slice(0, BLOCK_N // 2)._reinterpret(gl.int32, [TILES, T, WPT], FLAT).permute([1, 0, 2]).load(LA)
    wh = words.slice(BLOCK_N // 2, BLOCK_N // 2)._reinterpret(gl.int32, [TILES, T, WPT], FLAT).permute(
        [1, 0, 2]).load(LA)
    gl.thread_barrier()  # every thread has read the stage: the copy below may overwrite it
    _ring_copy(w_desc, ring, bars, stage, i + STAGES, row0, row_h, col0, i + STAGES < n_spans, SPAN_WORDS, BLOCK_N,
               GATED)
    return wg, wh


@gluon.jit
def _int4_mma_tma_kernel(x_ptr, w_desc, s_ptr, m_ptr, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr, M, N, K,
                         k_per_split, stride_x, stride_sn: gl.constexpr, HALF: gl.constexpr,
                         GROUP: gl.constexpr, EVEN_K: gl.constexpr, EVEN_N: gl.constexpr, HAS_BIAS: gl.constexpr,
                         HAS_RESIDUAL: gl.constexpr, SPLITS: gl.constexpr, TILES: gl.constexpr, COLS: gl.constexpr,
                         WARPS: gl.constexpr, PAIR: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr,
                         RELEASE_EARLY: gl.constexpr, PDL: gl.constexpr):
    """_int4_mma_kernel with the weights copied by TMA into a ring of STAGES spans in shared memory: the copies
    in flight hold no registers. w_desc: the packed weight as 32-bit words, [BLOCK_N, GROUP / 8] a block. A
    stage's rows map to threads as [rows g or g + 8, tiles, threads, words], so thread (w, l) of tile i reads
    row i 8 WARPS + 8 w + l // 4 (g) and that + 8 TILES WARPS (g + 8). Two spans a step, each with registers of
    its own for its x, scales and mins: one span's are loaded while the other is multiplied. With one span
    carried into the next step, ptxas copied the loads into the loop's registers at the step's end and waited
    for them there (Nsight Compute: 14.5% of stall samples); two spans take 154 registers against 116, and gate/up
    runs in 24.6 us against 26.7 (H200, docs/BENCHMARKS.md). GATED (_int4_mma_kernel): a stage's first half
    holds gate rows, its second the up rows HALF further, w_desc's block [BLOCK_N / 2, GROUP / 8]. stride_sn and
    HALF are compile-time constants and, with EVEN_N (no program has rows past N), a thread's scales and mins lie
    at constant offsets from its program's first row's: all of a span's loads take one address and an immediate
    each (down 138 registers against 158; H100, down alone 14.3 us against 14.9, batch 1 474.8 tokens/s against
    466.2, docs/BENCHMARKS.md). RELEASE_EARLY: MmaGemvConfig.release_early."""
    WPT: gl.constexpr = GROUP // 32
    L4: gl.constexpr = gl.BlockedLayout([1, TILES, COLS, WPT], [32, 1, 1, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
    LA: gl.constexpr = gl.SliceLayout(2, L4)
    LB: gl.constexpr = gl.SliceLayout(1, L4)
    LP: gl.constexpr = gl.SliceLayout(3, L4)
    LS: gl.constexpr = gl.SliceLayout(2, LP)
    LX: gl.constexpr = gl.BlockedLayout([1, COLS, 2 * WPT], [32, 1, 1], [WARPS, 1, 1], [2, 1, 0])
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    T: gl.constexpr = 32 * WARPS
    BLOCK_N: gl.constexpr = 16 * TILES * WARPS
    SPAN_WORDS: gl.constexpr = GROUP // 8

    tid = gl.arange(0, T, layout=gl.SliceLayout(1, LS))
    lane = tid % 32
    tile = gl.arange(0, TILES, layout=gl.SliceLayout(0, LS))
    if GATED:
        row0 = gl.program_id(0) * (BLOCK_N // 2)
        row_h = row0 + HALF
    else:
        row0 = gl.program_id(0) * BLOCK_N
        row_h = row0
    in_g = (tid // 4)[:, None] + tile[None, :] * (8 * WARPS)  # rows g from the program's first
    in_h = in_g + (HALF if GATED else 8 * WARPS * TILES)
    rows_g = row0 + in_g
    rows_h = row0 + in_h
    if EVEN_N:
        first_s = s_ptr + row0.to(gl.int64) * stride_sn
        first_m = m_ptr + row0.to(gl.int64) * stride_sn
        s_rows_g = first_s + in_g * stride_sn
        s_rows_h = first_s + in_h * stride_sn
        m_rows_g = first_m + in_g * stride_sn
        m_rows_h = first_m + in_h * stride_sn
    else:
        _, _, s_rows_g, s_rows_h, m_rows_g, m_rows_h = _row_params(rows_g, rows_h, s_ptr, m_ptr, N, stride_sn)
    x_run, xw_k = _x_words(x_ptr, M, stride_x, T, COLS, WPT, LX)

    ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, SPAN_WORDS], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    k_lo = gl.program_id(1) * k_per_split
    k_end = gl.minimum(k_lo + k_per_split, K)
    n_spans = (k_end - k_lo + GROUP - 1) // GROUP
    col0 = k_lo // 8
    for i in gl.static_range(STAGES):
        _ring_copy(w_desc, ring, bars, i, i, row0, row_h, col0, i < n_spans, SPAN_WORDS, BLOCK_N, GATED)
    p0 = gl.zeros([T, TILES, COLS], gl.float32, LP)
    p1 = gl.zeros([T, TILES, COLS], gl.float32, LP)
    p2 = gl.zeros([T, TILES, COLS], gl.float32, LP)
    p3 = gl.zeros([T, TILES, COLS], gl.float32, LP)
    last = k_lo + (n_spans - 1) * GROUP
    if PDL:
        gdc_wait()
        if RELEASE_EARLY:
            gdc_launch_dependents()
    side_a = _load_side(s_rows_g, s_rows_h, m_rows_g, m_rows_h, x_run, xw_k, k_lo, K, GROUP, EVEN_K)
    for i in range(0, n_spans, 2):  # two spans a step: each one's side loads fly while the other is multiplied
        side_b = _load_side(s_rows_g, s_rows_h, m_rows_g, m_rows_h, x_run, xw_k,
                            gl.minimum(k_lo + (i + 1) * GROUP, last), K, GROUP, EVEN_K)
        wg, wh = _ring_span(w_desc, ring, bars, i, n_spans, row0, row_h, col0, T, TILES, WPT, STAGES, SPAN_WORDS,
                            BLOCK_N, LA, FLAT, GATED)
        p0, p1, p2, p3 = _span_mma((wg, wh) + side_a, p0, p1, p2, p3, LB, PAIR)
        side_a = _load_side(s_rows_g, s_rows_h, m_rows_g, m_rows_h, x_run, xw_k,
                            gl.minimum(k_lo + (i + 2) * GROUP, last), K, GROUP, EVEN_K)
        if i + 1 < n_spans:
            wg, wh = _ring_span(w_desc, ring, bars, i + 1, n_spans, row0, row_h, col0, T, TILES, WPT, STAGES,
                                SPAN_WORDS, BLOCK_N, LA, FLAT, GATED)
            p0, p1, p2, p3 = _span_mma((wg, wh) + side_b, p0, p1, p2, p3, LB, PAIR)
    if PDL and not RELEASE_EARLY:
        gdc_launch_dependents()
    _finish(p0, p1, p2, p3, rows_g, rows_h, lane, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr, M, N, HALF,
            HAS_BIAS, HAS_RESIDUAL, SPLITS, COLS, PAIR, GATED, LP)


def supports(x: torch.Tensor, qweight: torch.Tensor, group: int, in_features: int) -> bool:
    """Whether int4_mma_gemv takes this call: bf16 x of 1 to 16 rows on an sm_80+ GPU (mma.sync with bf16),
    groups of 32, 64 or 128, K a multiple of 8 (a thread's x is whole 32-bit pairs) and x and the packed weight
    at 4-byte aligned addresses (both are read as 32-bit words)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and 0 < x.numel() <= MAX_ROWS * in_features
            and group in (32, 64, 128) and in_features % 8 == 0 and x.data_ptr() % 4 == 0
            and qweight.data_ptr() % 4 == 0 and qweight.stride(-1) == 1 and torch.version.hip is None
            and torch.cuda.get_device_capability(x.device)[0] >= 8)


def has_tma(qweight: torch.Tensor) -> bool:
    """Whether the packed weight can be read by TMA copies: an NVIDIA GPU of compute capability 9.0 or later,
    a 16-byte aligned base and rows (the copies' alignment)."""
    return (qweight.is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(qweight.device)[0] >= 9
            and qweight.data_ptr() % 16 == 0 and qweight.stride(0) % 16 == 0)


def int4_mma_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                  in_features: int, group: int, bias: torch.Tensor | None = None,
                  config: MmaGemvConfig | None = None, *, residual: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, silu_and_mul_out: bool = False) -> torch.Tensor:
    """quant_linear (triton_quant.py) for INT4 weights and x of at most 16 rows (supports()). silu_and_mul_out:
    the weight is cat(gate, up) and the result silu(gate) * up ([..., n / 2]), in the product's own store."""
    k = in_features
    n = qweight.shape[0]
    if silu_and_mul_out and (n % 2 or residual is not None):
        raise ValueError(f"SiLU·mul of the output needs an even number of rows (cat(gate, up)) and no residual; "
                         f"got {n} rows{' and a residual' if residual is not None else ''}")
    half = n // 2 if silu_and_mul_out else n
    tma = (config is None or config.stages > 0) and has_tma(qweight)  # quant_linear passes its chosen config
    cfg = config or default_config(x.numel() // k, n, k, tma) or MMA_CFG
    if cfg.stages and not tma:
        raise ValueError(f"MmaGemvConfig.stages={cfg.stages} reads the weight by TMA, which needs an sm_90+ NVIDIA "
                         "GPU and a packed weight whose base and rows are 16-byte aligned")
    if cfg.stages and cfg.block_n > 256:
        raise ValueError(f"a TMA copy holds at most 256 rows; MmaGemvConfig with stages has {cfg.block_n} "
                         f"(16 x tiles x num_warps)")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1 or x2.stride(0) != k:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if residual is not None:
        if residual.numel() != m * n:
            raise ValueError(f"residual has {residual.numel()} elements, the output {m * n}")
        residual = residual.reshape(m, n).contiguous()
    out = torch.empty(m, half, dtype=out_dtype or x.dtype, device=x.device)
    # gated, a program takes block_n / 2 outputs, the rows of both halves: as many programs as without the gate
    row_tiles = triton.cdiv(n, cfg.block_n)
    spans = triton.cdiv(k, group)
    slots = cfg.programs_per_sm * num_sms(x.device.index or 0)
    split = cfg.split_k or (slots // row_tiles if cfg.stages else triton.cdiv(slots, row_tiles))
    split = max(1, min(split, spans, 32))
    k_per_split = triton.cdiv(spans, split) * group
    split = triton.cdiv(k, k_per_split)
    part = torch.empty(split * m * n, dtype=torch.float32, device=x.device) if split > 1 else out
    counter = counters(x.device, row_tiles) if split > 1 else out
    args = (out if bias is None else bias, out if residual is None else residual, out, part, counter, m, n, k,
            k_per_split)
    consts = dict(GROUP=group, EVEN_K=k % group == 0, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                  SPLITS=split, TILES=cfg.tiles, WARPS=cfg.num_warps, COLS=triton.cdiv(m, 8), PAIR=m > 1,
                  GATED=silu_and_mul_out, num_warps=cfg.num_warps, **pdl_args(x))
    if cfg.stages:
        words = qweight.view(torch.int32)
        box_rows = cfg.block_n // 2 if silu_and_mul_out else cfg.block_n
        desc = TensorDescriptor(words, list(words.shape), list(words.stride()), [box_rows, group // 8],
                                gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
        even_n = half % (cfg.block_n // 2) == 0 if silu_and_mul_out else n % cfg.block_n == 0
        _int4_mma_tma_kernel[(row_tiles, split)](x2.view(torch.int32), desc, scales, mins, *args, k // 2,
                                                 scales.stride(0), half, EVEN_N=even_n, STAGES=cfg.stages,
                                                 RELEASE_EARLY=cfg.release_early, **consts)
    else:
        _int4_mma_kernel[(row_tiles, split)](x2.view(torch.int32), qweight.view(torch.int32), scales, mins, *args,
                                             qweight.stride(0) // 4, k // 2, scales.stride(0), half, **consts)
    return out.view(*x.shape[:-1], half)
