"""Batch-1 decode matmul in Triton: y = x @ W.T + b for a single row x, W float (bf16, fp16, fp32), packed
INT8 / INT4, or FP8 e4m3 (tokenmill/quant/formats.py; FP8's x arrives quantized and scaled back to float32 by
triton_fp8_linear.quantize_rows). Decode at batch 1 reads every weight once per token, so this is the
kernel that bounds batch-1 speed. Its store also adds a residual (the o and down projections), casts (float32
logits), and, for float weights with an RMS norm's weight folded in, normalizes: x's sum of squares is taken in
the main loop and the outputs are scaled by rsqrt(mean + eps) (torch_ref.linear).

No tensor cores: a [BLOCK_N, BLOCK_K] weight tile times x broadcast along the rows, accumulated in fp32
registers and reduced along K once at the end. A 16-row tile for a dot (triton_quant.py) wastes 15 rows of
work and moves each dequantized weight through shared memory into the dot's layout; here a weight lives in one
thread's registers from load to product.

Dequantization without int-to-float conversions (GemvConfig.dequant): on Hopper a conversion issues at a quarter
of the float rate, about as long as reading an INT4 weight takes. "bits": a nibble ORed into the mantissa of 2^23
(where the ulp is 1) is exactly 2^23 + q as a float, an int8 plus 2^23 + 128 likewise, and subtracting the
constant is exact. "prmt" (INT4): one PTX byte permute puts a packed byte under the exponent of 2^23, one AND per
nibble keeps it (the high nibble as 16 q, its x scaled by 1/16), and a fused multiply-add with -2^23 x removes the
offset exactly: three integer instructions a byte instead of six (counted in the SASS). Either way a group's
scale and min are applied once per packed byte (nibble pair): sum (q s + m) x = s sum q x + m sum x.

"unit" (its own kernel; the default for INT4 and INT8 with 16-bit activations): the
weight becomes a float near 1.0 instead of near 2^23, so the offset can stay in the sum. INT4: 1 + q / 128 (low nibble) and 1 + q / 2048 (high nibble, its x
times 16); INT8: 1 + (q + 128) / 2^15 (one LOP3 flips a word's four sign bits, one byte permute a weight puts it
in mantissa bits 8-15). Each weight then costs one fused multiply-add into a thread's partial sum over CHUNK
bytes of a row; a chunk's sum of x takes the offset off, and a group's scale (and min) apply once per chunk:
INT4 3.6 to 5.6 SASS instructions a weight (256- to 64-row tiles) against 6.1 for "prmt"; INT8 3.5 to 3.9
against 5.7 for "bits" (sm_90, compiled here). float32 keeps ~16-17 bits of each product, which a 16-bit output
never sees (float32 activations take "prmt" and "bits"). INT8 rows must be whole 16-byte blocks (K a multiple of 16);
others run "bits".

When N / BLOCK_N tiles are too few to keep every multiprocessor streaming, K is split over programs, and the
split that finishes last adds the fp32 partial sums in split order (triton_arrive.py): one launch, and results
that never depend on timing.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_arrive import arrive_last, counters
from tokenmill.kernels.triton_pdl import pdl_args, pdl_release, pdl_wait

DENSE, INT8, INT4, FP8 = 0, 1, 2, 3
DEQUANT_MODES = ("cvt", "bits", "prmt", "unit")


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int  # input features per tile (INT4: bytes per row are half that)
    split_k: int = 0  # 0: split until there are about programs_per_sm programs per multiprocessor
    num_warps: int = 4
    dequant: str = "prmt"  # cvt | bits | prmt | unit (prmt: INT4, INT8 treats it as bits; unit: INT4, INT8); see above
    programs_per_sm: int = 4
    chunk: int = 16  # unit: bytes of a row summed in one thread before the group's scale applies to them
    ahead: int = 1  # unit: sub-tiles loaded ahead of the one being summed (1 or 2)
    early: bool = False  # unit: the first sub-tiles load before the PDL wait (weights: no kernel of a step writes them)
    release_early: bool = False  # unit: release the next kernel right after the PDL wait, not after the loop

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "chunk"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.block_k < 32:  # an INT4 sub-tile starts at a 32-input packing block
            raise ValueError(f"GemvConfig.block_k must be at least 32, got {self.block_k}")
        if self.ahead not in (1, 2):
            raise ValueError(f"GemvConfig.ahead must be 1 or 2, got {self.ahead}")
        if self.dequant not in DEQUANT_MODES:
            raise ValueError(f"GemvConfig.dequant must be one of {', '.join(DEQUANT_MODES)}, got {self.dequant!r}")


# Tuned on the H200 with `python -m tokenmill.kernels.bench_gemv --tune`, 2026-11-30 (docs/BENCHMARKS.md): the
# least total time over a Llama-3-8B layer's four matrices, and per-shape tiles where one matrix gains: WIDE for
# WIDE_N outputs or more (gate/up; INT8: 35.4 us against 37.4; bf16: 56.8 against 57.6), DEEP for at least twice
# as many inputs as outputs (down; bf16: 30.5 against 31.8; INT4: 17.2 against 21.7). INT4's default tile is
# the best of qkv and o (9.0 and 7.2 us against 11.4 and 8.6 with the 64-row tile): since a K split costs no
# second launch, wide tiles split many ways win. INT8 "unit" (searched over 12 tiles, 2026-11-30): gate/up 30.6 us
# (90% of copy) against 35.2 with "bits", down 18.0 against 18.7. qkv and o lost on "unit" alone (10.1-16.8 and
# 7.7-10.7 us against 10.4 and 7.0), but with `early` the gate/up tile serves them too: batch-1 INT8 decode 399.0
# tokens/s against 396.1 (64 rows: 390.9; 32 rows and 2 or 8 programs a multiprocessor: 395.5, 384.5). "bits"
# stays for float32 activations and rows "unit" cannot load as 16-byte words. `release_early` (2026-12-07, H100,
# one engine, interleaved): batch-1 INT8 decode 333.6 tokens/s against 324.1, batch 8 unchanged; on INT4's o
# (INT4_SQUARE_CFG) it lost 7% (448.5 against 482.0), so INT4 keeps the release after the loop.
DENSE_CFG = GemvConfig(8, 512, num_warps=4, dequant="cvt", programs_per_sm=2)  # cvt: nothing to dequantize
DENSE_WIDE_CFG = GemvConfig(16, 256, num_warps=4, dequant="cvt", programs_per_sm=2)
DENSE_DEEP_CFG = GemvConfig(4, 512, num_warps=8, dequant="cvt", programs_per_sm=2)
INT8_CFG = GemvConfig(32, 256, num_warps=4, dequant="unit", programs_per_sm=4, chunk=16, early=True,
                      release_early=True)
INT8_WIDE_CFG = INT8_CFG
INT8_BITS_CFG = GemvConfig(4, 1024, num_warps=4, dequant="bits", programs_per_sm=1)
INT8_DEEP_CFG = GemvConfig(64, 256, num_warps=4, dequant="unit", programs_per_sm=4, chunk=16, early=True,
                           release_early=True)
INT4_CFG = GemvConfig(256, 128, num_warps=8, dequant="unit", programs_per_sm=2, chunk=16)
INT4_WIDE_CFG = GemvConfig(256, 128, num_warps=4, dequant="unit", programs_per_sm=2, chunk=16)
INT4_DEEP_CFG = GemvConfig(128, 128, num_warps=4, dequant="unit", programs_per_sm=4, chunk=16, ahead=2)
# As many outputs as inputs or fewer (an o projection): INT4_CFG's split leaves each program two sub-tiles, and
# both load before the PDL wait, while the attention before it runs (batch-1 INT4 decode, 2026-12-06, with the
# decode attention's short-context split: H200 475.2 tokens/s against 467.1, H100 428.2 against 420.7; qkv
# loaded the same way lost on the H100, 411.4 against 413.3).
INT4_SQUARE_CFG = GemvConfig(256, 128, num_warps=8, dequant="unit", programs_per_sm=2, chunk=16, ahead=2,
                             early=True)
WIDE_N = 16384
# float32 activations keep full precision: "unit" would round each product to ~17 bits.
INT4_FP32_CFG = GemvConfig(64, 256, num_warps=4, dequant="prmt", programs_per_sm=4)
# FP8: e4m3 -> float32 is one conversion a pair to fp16 and one a weight to float32 ("cvt"). Tiles searched on the
# H200 (`bench_gemv --tune fp8`, 2026-12-02): qkv 8.6 us, o 7.2 (6.5 with 1/SM n8 k1024), gate/up 33.1 (83% of
# copy), down 17.4 (79%), against 10.4 / 6.7 / 36.9 / 17.5 with n8 k1024 2/SM for all four.
FP8_CFG = GemvConfig(16, 512, num_warps=8, dequant="cvt", programs_per_sm=2)
FP8_WIDE_CFG = GemvConfig(16, 256, num_warps=4, dequant="cvt", programs_per_sm=1)
FP8_DEEP_CFG = GemvConfig(8, 1024, num_warps=4, dequant="cvt", programs_per_sm=2)
INT8_FP32_WIDE_CFG = GemvConfig(16, 512, num_warps=8, dequant="bits", programs_per_sm=4)


@triton.jit
def group_param(ptr, row_off, n_mask, k0, n_groups, GROUP: tl.constexpr, DTYPE: tl.constexpr = tl.float32):
    """Scale (or min) of the input group holding column k0, one per row ([BLOCK_N, 1]) in DTYPE. Kernels cut
    their tiles into sub-tiles of one group each: broadcasting several groups' values over a tile's columns
    needs a reshape whose layout conversion, through shared memory, cost INT4 decode about 3x."""
    g = k0 // GROUP
    return tl.load(ptr + row_off + g, mask=n_mask & (g < n_groups), other=0.0).to(DTYPE)


@triton.jit
def int4_subtile(w_rows, n_mask, ks, K, HALF: tl.constexpr):
    """The packed bytes of an INT4 sub-tile starting at input ks (a multiple of 32: packing blocks are 32 inputs),
    and the inputs of their nibbles: byte i holds input ks + (i // 16) * 32 + i % 16 in its low nibble (kl) and
    that + 16 in its high nibble (kh)."""
    offs_i = tl.arange(0, HALF)
    kl = ks + (offs_i // 16) * 32 + offs_i % 16
    packed = tl.load(w_rows + (ks // 2 + offs_i)[None, :], mask=n_mask & (kl < K)[None, :], other=0)
    return packed, kl, kl + 16


@functools.lru_cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@triton.jit
def _int8_to_float(q, BITS: tl.constexpr):
    """int8 values as float32, exactly."""
    if BITS:
        return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
    return q.to(tl.float32)


@triton.jit
def _magic_nibbles(packed):
    """Each packed byte as two floats: 2^23 + low nibble and 2^23 + 16 * high nibble (PTX: one byte permute and
    two ANDs a byte)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 m, w0, w1, w2, w3;
        mov.b32 m, 0x4B000000;
        prmt.b32 w0, $8, m, 0x7540;
        prmt.b32 w1, $8, m, 0x7541;
        prmt.b32 w2, $8, m, 0x7542;
        prmt.b32 w3, $8, m, 0x7543;
        and.b32 $0, w0, 0x4B00000F;
        and.b32 $1, w1, 0x4B00000F;
        and.b32 $2, w2, 0x4B00000F;
        and.b32 $3, w3, 0x4B00000F;
        and.b32 $4, w0, 0x4B0000F0;
        and.b32 $5, w1, 0x4B0000F0;
        and.b32 $6, w2, 0x4B0000F0;
        and.b32 $7, w3, 0x4B0000F0;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[packed], dtype=(tl.float32, tl.float32), is_pure=True,
        pack=4)


@triton.jit
def _store_rows(y, ssq, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr, offs_n, N, K, eps,
                HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, SPLITS: tl.constexpr):
    """A program's rows in out's dtype, through _store_out. With K split over programs, each stores its fp32
    partial sums (and, with NORM, its slice's sum of squares of x after every split's rows), and the split that
    finishes last adds them up in split order (triton_arrive.py): no second kernel. The merge is unrolled
    (SPLITS, the number of splits, is a constant), so every partial's load is in flight at once."""
    if SPLITS > 1:
        ssq_ptr = part_ptr + SPLITS * N + tl.program_id(0) * SPLITS
        tl.store(part_ptr + tl.program_id(1) * N + offs_n, y, mask=offs_n < N)
        if NORM:
            tl.store(ssq_ptr + tl.program_id(1), ssq)
        if arrive_last(counter_ptr + tl.program_id(0), SPLITS):
            total = tl.zeros_like(y)
            total_sq = tl.full([], 0.0, tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(part_ptr + s * N + offs_n, mask=offs_n < N, other=0.0, cache_modifier=".cg")
                if NORM:
                    total_sq += tl.load(ssq_ptr + s, cache_modifier=".cg")
            _store_out(total, total_sq, b_ptr, r_ptr, out_ptr, offs_n, N, K, eps, HAS_BIAS, HAS_RESIDUAL, NORM)
    else:
        _store_out(y, ssq, b_ptr, r_ptr, out_ptr, offs_n, N, K, eps, HAS_BIAS, HAS_RESIDUAL, NORM)


@triton.jit
def _store_out(y, ssq, b_ptr, r_ptr, out_ptr, offs_n, N, K, eps,
               HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr):
    """y * rsqrt(mean(x^2) + eps) with NORM (x's RMS norm, its weight folded into W), + bias, + residual."""
    if NORM:
        y = y * tl.rsqrt(ssq / K + eps)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        y += tl.load(r_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _unit_word(word):
    """A packed INT4 word (bytes 0-3) as floats near 1, in byte order: [..., 4] low nibbles (1 + q / 128) and
    [..., 4] high nibbles (1 + q / 2048). PTX: one byte permute puts a byte under 1.0's exponent twice, one LOP3
    a nibble keeps it."""
    l0, l1, l2, l3, h0, h1, h2, h3 = tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 w0, w1, w2, w3;
        prmt.b32 w0, $8, 0x3F800000, 0x7004;
        prmt.b32 w1, $8, 0x3F800000, 0x7114;
        prmt.b32 w2, $8, 0x3F800000, 0x7224;
        prmt.b32 w3, $8, 0x3F800000, 0x7334;
        lop3.b32 $0, w0, 0xFF0F0000, 0x00800000, 0xEA;
        lop3.b32 $1, w1, 0xFF0F0000, 0x00800000, 0xEA;
        lop3.b32 $2, w2, 0xFF0F0000, 0x00800000, 0xEA;
        lop3.b32 $3, w3, 0xFF0F0000, 0x00800000, 0xEA;
        lop3.b32 $4, w0, 0xFF00F000, 0x00800000, 0xEA;
        lop3.b32 $5, w1, 0xFF00F000, 0x00800000, 0xEA;
        lop3.b32 $6, w2, 0xFF00F000, 0x00800000, 0xEA;
        lop3.b32 $7, w3, 0xFF00F000, 0x00800000, 0xEA;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[word], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    # join adds the last axis: ((0, 2), (1, 3)) flattens to 0, 1, 2, 3
    return tl.join(tl.join(l0, l2), tl.join(l1, l3)), tl.join(tl.join(h0, h2), tl.join(h1, h3))


@triton.jit
def _unit_int8_word(word):
    """A word of four int8 weights as floats near 1, in byte order: 1 + (q + 128) / 2^15. PTX: one LOP3 flips
    the word's four sign bits (q + 128 as a byte), one byte permute a weight puts it under 1.0's exponent, in
    mantissa bits 8-15."""
    f0, f1, f2, f3 = tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 u;
        xor.b32 u, $4, 0x80808080;
        prmt.b32 $0, u, 0x3F800000, 0x7604;
        prmt.b32 $1, u, 0x3F800000, 0x7614;
        prmt.b32 $2, u, 0x3F800000, 0x7624;
        prmt.b32 $3, u, 0x3F800000, 0x7634;
        }""",
        constraints="=r,=r,=r,=r,r", args=[word], dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    return tl.join(tl.join(f0, f2), tl.join(f1, f3))  # flattens to bytes 0, 1, 2, 3 (as in _unit_word)


@triton.jit
def _unit_params(s_ptr, m_ptr, s_off, n_mask, ks, n_groups, INT8: tl.constexpr, GROUP: tl.constexpr):
    """The scales and mins ([BLOCK_N, 1]) of the sub-tile at input ks (one group), loaded with its words; zeros
    where a kernel has none (INT8 has no mins, and with GROUP 0 one scale a row, applied to the row's sum)."""
    if GROUP > 0:
        scale = group_param(s_ptr, s_off, n_mask, ks, n_groups, GROUP)
    else:
        scale = tl.zeros([1, 1], tl.float32)
    if INT8:
        low = tl.zeros([1, 1], tl.float32)
    else:
        low = group_param(m_ptr, s_off, n_mask, ks, n_groups, GROUP)
    return scale, low


@triton.jit
def _int8_unit_subtile(q, part, x_ptr, scale, ks, K, k_of_weight,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, C: tl.constexpr, CHUNK: tl.constexpr):
    """One sub-tile of INT8 words q added to part, the rows' partial sums by CHUNK weights ([BLOCK_N, C]): each
    chunk's sum of x takes the offset 1 off at once, while the sum is about as large as its products."""
    kk = ks + k_of_weight
    x = tl.reshape(tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :], [1, C, CHUNK])
    v = tl.reshape(_unit_int8_word(q), [BLOCK_N, C, CHUNK])
    x_sum = tl.sum(x, 2)
    dot = (tl.sum(v * x, 2) - x_sum) * 32768.0 - x_sum * 128.0  # sum (q + 128) x - 128 sum x
    if GROUP > 0:
        dot = dot * scale
    return part + dot


@triton.jit
def _int4_unit_subtile(q, part, x_ptr, scale, low, ks, K, k_of_byte,
                       BLOCK_N: tl.constexpr, C: tl.constexpr, CHUNK: tl.constexpr):
    """One sub-tile of packed words q added to part, the rows' partial sums by CHUNK bytes ([BLOCK_N, C])."""
    kl = ks + k_of_byte
    x_lo = tl.load(x_ptr + kl, mask=kl < K, other=0.0).to(tl.float32)[None, :]
    x_hi = tl.load(x_ptr + kl + 16, mask=kl + 16 < K, other=0.0).to(tl.float32)[None, :]
    v_lo, v_hi = _unit_word(q)
    v_lo = tl.reshape(v_lo, [BLOCK_N, C, CHUNK])
    v_hi = tl.reshape(v_hi, [BLOCK_N, C, CHUNK])
    x_lo = tl.reshape(x_lo, [1, C, CHUNK])
    x_hi16 = tl.reshape(x_hi, [1, C, CHUNK]) * 16.0
    dot = tl.sum(v_lo * x_lo, 2) + tl.sum(v_hi * x_hi16, 2)
    offset = tl.sum(x_lo + x_hi16, 2)
    x_sum = tl.sum(x_lo + x_hi16 * 0.0625, 2)
    return part + (dot - offset) * (scale * 128.0) + x_sum * low


@triton.jit
def _word_tile(rows, n_mask, word, k_of_word, ks, k_hi, K, PER_WORD: tl.constexpr):
    """The packed words (PER_WORD inputs each) of the sub-tile at input ks; zeros past K or past this split."""
    w0 = tl.multiple_of(ks // PER_WORD, 4)  # splits and sub-tiles start on 16-byte blocks
    return tl.load(rows + (w0 + word)[None, :], mask=n_mask & ((ks + k_of_word < K) & (ks < k_hi))[None, :], other=0)


@triton.jit
def _unit_kernel(x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr, N, K, n_groups,
                 k_per_split, stride_wb, stride_sn,
                 INT8: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, CHUNK: tl.constexpr,
                 AHEAD: tl.constexpr, EARLY: tl.constexpr, RELEASE_EARLY: tl.constexpr, PDL: tl.constexpr):
    """INT4 or INT8 with "unit" dequantization (module docstring). w_ptr is the weight as 32-bit words, stride_wb
    its row stride in 16-byte blocks: as bytes, a tile carried from one step to the next is re-packed at every
    use. Words, scales and mins are loaded AHEAD sub-tiles ahead, so each program keeps one or two sub-tiles in
    flight while it sums the one before; with EARLY the first ones load before the PDL wait, with RELEASE_EARLY
    the next kernel is released right after it. INT8 with GROUP 0 has one scale a row (per channel), applied to
    the row's sum."""
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < N)[:, None]
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * (stride_wb * 4)  # a row is whole 16-byte blocks
    s_off = offs_n.to(tl.int64)[:, None] * stride_sn
    PER_WORD: tl.constexpr = 4 if INT8 else 8
    C: tl.constexpr = (SUB if INT8 else SUB // 2) // CHUNK
    word = tl.arange(0, SUB // PER_WORD)
    if INT8:
        k_of_word = (word // 4) * 16  # the first input of the word's 16-byte block (K is a multiple of 16)
        k_of_input = tl.arange(0, SUB)
    else:
        byte = tl.arange(0, SUB // 2)
        k_of_input = (byte // 16) * 32 + byte % 16  # the input of the byte's low nibble
        k_of_word = (word // 4) * 32  # the first input of the word's packing block: rows are padded to blocks
    k_lo = pid_k * k_per_split
    k_hi = k_lo + k_per_split  # tiles past K are masked off; only the last split has any
    part = tl.zeros([BLOCK_N, C], tl.float32)
    if not EARLY:
        pdl_wait(PDL)
    nxt = _word_tile(rows, n_mask, word, k_of_word, k_lo, k_hi, K, PER_WORD)
    nxt_s, nxt_m = _unit_params(s_ptr, m_ptr, s_off, n_mask, k_lo, n_groups, INT8, GROUP)
    if AHEAD == 2:
        nxt2 = _word_tile(rows, n_mask, word, k_of_word, k_lo + SUB, k_hi, K, PER_WORD)
        nxt2_s, nxt2_m = _unit_params(s_ptr, m_ptr, s_off, n_mask, k_lo + SUB, n_groups, INT8, GROUP)
    if EARLY:
        pdl_wait(PDL)
    if RELEASE_EARLY:
        pdl_release(PDL)
    for ks in range(k_lo, k_hi, SUB):
        q = nxt
        scale = nxt_s
        low = nxt_m
        if AHEAD == 2:
            nxt = nxt2
            nxt_s = nxt2_s
            nxt_m = nxt2_m
            nxt2 = _word_tile(rows, n_mask, word, k_of_word, ks + 2 * SUB, k_hi, K, PER_WORD)
            nxt2_s, nxt2_m = _unit_params(s_ptr, m_ptr, s_off, n_mask, ks + 2 * SUB, n_groups, INT8, GROUP)
        else:
            nxt = _word_tile(rows, n_mask, word, k_of_word, ks + SUB, k_hi, K, PER_WORD)
            nxt_s, nxt_m = _unit_params(s_ptr, m_ptr, s_off, n_mask, ks + SUB, n_groups, INT8, GROUP)
        if INT8:
            part = _int8_unit_subtile(q, part, x_ptr, scale, ks, K, k_of_input, GROUP, BLOCK_N, C, CHUNK)
        else:
            part = _int4_unit_subtile(q, part, x_ptr, scale, low, ks, K, k_of_input, BLOCK_N, C, CHUNK)
    if not RELEASE_EARLY:
        pdl_release(PDL)
    y = tl.sum(part, 1)
    if INT8 and GROUP == 0:
        y = y * tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn, mask=offs_n < N, other=0.0).to(tl.float32)
    _store_rows(y, 0.0, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr, offs_n, N, K, 0.0, HAS_BIAS, HAS_RESIDUAL,
                False, SPLITS)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr, N, K, n_groups,
                 k_per_split, stride_wn, stride_sn, eps,
                 INT4: tl.constexpr, INT8: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
                 PER_CHANNEL: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, SPLITS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr, PRMT: tl.constexpr,
                 BITS: tl.constexpr, PDL: tl.constexpr):
    """Every dequantization but "unit". NORM (dense only) sums x^2 on the way: x is loaded for the products
    anyway."""
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < N)[:, None]
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_off = offs_n.to(tl.int64)[:, None] * stride_sn
    k_lo = pid_k * k_per_split
    k_hi = k_lo + k_per_split  # tiles past K are masked off; only the last split has any
    pdl_wait(PDL)
    # SUB: a sub-tile of one input group (group_param), all of BLOCK_K where a group is at least as long.
    if INT4:
        acc = tl.zeros([BLOCK_N, SUB // 2], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            for j in tl.static_range(BLOCK_K // SUB):
                ks = k0 + j * SUB
                packed, kl, kh = int4_subtile(w_rows, n_mask, ks, K, SUB // 2)
                scale = group_param(s_ptr, s_off, n_mask, ks, n_groups, GROUP)
                low = group_param(m_ptr, s_off, n_mask, ks, n_groups, GROUP)
                x_lo = tl.load(x_ptr + kl, mask=kl < K, other=0.0).to(tl.float32)
                x_hi = tl.load(x_ptr + kh, mask=kh < K, other=0.0).to(tl.float32)
                if PRMT:  # (x * -2^23 would overflow only for |x| > 2^104)
                    v_lo, v_hi16 = _magic_nibbles(packed)
                    qx = tl.fma(v_lo, x_lo[None, :], (x_lo * -8388608.0)[None, :])
                    qx += tl.fma(v_hi16, (x_hi * 0.0625)[None, :], (x_hi * -524288.0)[None, :])
                else:
                    p32 = packed.to(tl.int32)
                    if BITS:
                        q_lo = ((p32 & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                        q_hi = ((p32 >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                    else:
                        q_lo = (p32 & 15).to(tl.float32)
                        q_hi = (p32 >> 4).to(tl.float32)
                    qx = q_lo * x_lo[None, :]
                    qx += q_hi * x_hi[None, :]
                acc += qx * scale
                acc += (x_lo + x_hi)[None, :] * low
    else:
        offs_k = tl.arange(0, SUB)
        acc = tl.zeros([BLOCK_N, SUB], tl.float32)
        sq = tl.zeros([SUB], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            for j in tl.static_range(BLOCK_K // SUB):
                kk = k0 + j * SUB + offs_k
                if FP8:
                    w = tl.load(w_rows + kk[None, :], mask=n_mask & (kk < K)[None, :], other=0.0)
                else:
                    w = tl.load(w_rows + kk[None, :], mask=n_mask & (kk < K)[None, :], other=0)
                if INT8:
                    w = _int8_to_float(w, BITS)
                    if not PER_CHANNEL:
                        w = w * group_param(s_ptr, s_off, n_mask, k0 + j * SUB, n_groups, GROUP)
                else:
                    w = w.to(tl.float32)
                x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                acc += w * x[None, :]
                if NORM:
                    sq += x * x
    pdl_release(PDL)
    y = tl.sum(acc, axis=1)
    if PER_CHANNEL:
        y = y * tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn, mask=offs_n < N, other=0.0).to(tl.float32)
    ssq = 0.0
    if NORM:
        ssq = tl.sum(sq, 0)
    _store_rows(y, ssq, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr, offs_n, N, K, eps, HAS_BIAS, HAS_RESIDUAL,
                NORM, SPLITS)


def sub_tile(group: int, block_k: int) -> int:
    """Columns of a sub-tile: one input group where groups are shorter than the tile, else the tile."""
    return group if 0 < group < block_k else block_k


def default_config(kind: int, n: int = 0, *, k: int = 0, dtype: torch.dtype = torch.bfloat16) -> GemvConfig:
    """The tuned config for a kind of weight with n output and k input features and activations of dtype."""
    if kind == INT4 and dtype == torch.float32:
        return INT4_FP32_CFG
    if kind == INT8 and dtype == torch.float32:
        return INT8_FP32_WIDE_CFG if n >= WIDE_N else INT8_BITS_CFG
    if n >= WIDE_N:
        return (DENSE_WIDE_CFG, INT8_WIDE_CFG, INT4_WIDE_CFG, FP8_WIDE_CFG)[kind]
    if k >= 2 * n > 0:
        return (DENSE_DEEP_CFG, INT8_DEEP_CFG, INT4_DEEP_CFG, FP8_DEEP_CFG)[kind]
    if kind == INT4 and 0 < n <= k:
        return INT4_SQUARE_CFG
    return (DENSE_CFG, INT8_CFG, INT4_CFG, FP8_CFG)[kind]


def _splits(cfg: GemvConfig, n: int, k: int, device: torch.device) -> int:
    """How many programs share a row tile's K: cfg.split_k, or enough to give each multiprocessor about
    programs_per_sm programs."""
    k_tiles = triton.cdiv(k, cfg.block_k)
    if cfg.split_k or device.type != "cuda":
        return min(cfg.split_k or 1, k_tiles)
    target = cfg.programs_per_sm * num_sms(device.index or 0)
    return max(1, min(triton.cdiv(target, triton.cdiv(n, cfg.block_n)), k_tiles, 32))


def _unit(kind: int, cfg: GemvConfig, w: torch.Tensor, k: int) -> bool:
    """Whether "unit" dequantization runs: INT4 (rows are whole 16-byte packing blocks), or INT8 whose rows are
    whole 16-byte blocks too (any other INT8 runs "bits")."""
    if cfg.dequant != "unit":
        return False
    return kind == INT4 or (kind == INT8 and k % 16 == 0 and w.stride(0) % 16 == 0 and w.data_ptr() % 16 == 0)


def _launch(kind: int, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None,
            n: int, k: int, group: int, bias: torch.Tensor | None, cfg: GemvConfig | None, *,
            rms_eps: float | None = None, residual: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if rms_eps is not None and kind != DENSE:
        raise ValueError("the GEMV normalizes its input only for float weights (a norm folds into those alone)")
    given = cfg is not None
    cfg = cfg or default_config(kind, n, k=k, dtype=x.dtype)
    unit = _unit(kind, cfg, w, k)
    if not given and cfg.dequant == "unit" and not unit:
        cfg = INT8_BITS_CFG  # an INT8 "unit" tile whose rows are not whole 16-byte blocks: the tuned "bits" one
    x1 = x.reshape(k)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    if residual is not None:
        if residual.numel() != n:
            raise ValueError(f"residual has {residual.numel()} elements, the output {n}")
        residual = residual.reshape(n).contiguous()
    out = torch.empty(n, dtype=out_dtype or x.dtype, device=x.device)
    split = _splits(cfg, n, k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), split) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, cfg.block_n), split)
    # split > 1: [split, n] fp32 partial rows, then [row tiles, split] partial sums of squares with rms_eps
    part_size = split * n + (grid[0] * split if rms_eps is not None else 0)
    part = torch.empty(part_size, dtype=torch.float32, device=x.device) if split > 1 else out
    counter = counters(x.device, grid[0]) if split > 1 else out
    per_channel = kind in (INT8, FP8) and group >= k
    group_k = 0 if per_channel or kind == DENSE else group
    s = w if scales is None else scales
    pdl = pdl_args(x)
    m = s if mins is None else mins
    b = out if bias is None else bias
    r = out if residual is None else residual
    n_groups = 1 if scales is None else scales.shape[1]
    sub = sub_tile(group_k, cfg.block_k)
    if unit:  # rows of whole 16-byte blocks: read as 32-bit words
        _unit_kernel[grid](x1, w.view(torch.int32), s, m, b, r, out, part, counter, n, k, n_groups, k_per_split,
                           w.stride(0) // 16, s.stride(0), INT8=kind == INT8, GROUP=group_k, HAS_BIAS=bias is not None,
                           HAS_RESIDUAL=residual is not None, SPLITS=split, BLOCK_N=cfg.block_n, SUB=sub,
                           CHUNK=min(cfg.chunk, sub if kind == INT8 else sub // 2), AHEAD=cfg.ahead,
                           EARLY=cfg.early, RELEASE_EARLY=cfg.release_early, num_warps=cfg.num_warps,
                           num_stages=1, **pdl)
    else:
        _gemv_kernel[grid](x1, w, s, m, b, r, out, part, counter, n, k, n_groups, k_per_split, w.stride(0),
                           s.stride(0), 0.0 if rms_eps is None else rms_eps,
                           INT4=kind == INT4, INT8=kind == INT8, FP8=kind == FP8, GROUP=group_k,
                           PER_CHANNEL=per_channel,
                           HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, NORM=rms_eps is not None,
                           SPLITS=split, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                           SUB=sub, PRMT=kind == INT4 and cfg.dequant == "prmt",
                           BITS=kind != DENSE and cfg.dequant != "cvt", num_warps=cfg.num_warps, num_stages=1,
                           **pdl)
    return out.view(*x.shape[:-1], n)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               config: GemvConfig | None = None, *, rms_eps: float | None = None,
               residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x holding one row ([..., K] with one element in the leading dims), in
    out_dtype (default x's). rms_eps: x is first RMS-normalized without a weight (torch_ref.linear); residual:
    added to the output."""
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    return _launch(DENSE, x, weight, None, None, weight.shape[0], weight.shape[1], 0, bias, config, rms_eps=rms_eps,
                   residual=residual, out_dtype=out_dtype)


def quant_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
               in_features: int, group: int, bias: torch.Tensor | None,
               config: GemvConfig | None = None, *, residual: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """quant_linear (triton_quant.py) for x holding one row (FP8: x already quantized and scaled back)."""
    kind = {torch.uint8: INT4, torch.float8_e4m3fn: FP8}.get(qweight.dtype, INT8)
    return _launch(kind, x, qweight, scales, mins, qweight.shape[0], in_features, group, bias, config,
                   residual=residual, out_dtype=out_dtype)


@triton.jit
def store_tile(acc, b_ptr, r_ptr, out_ptr, out_off, offs_n, N, out_mask,
               HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """A matmul tile (+ bias, + residual, laid out as the output) in the output's dtype (triton_quant's and
    triton_fp8_skinny's epilogue)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + out_off, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
