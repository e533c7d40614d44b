"""INT4 one-row decode matmul on integer dot products: y = x @ W.T (+ bias, + a residual) for one row of bf16 or
fp16 x and W packed INT4 (tokenmill/quant/formats.py), read as stored.

Why: the float kernels (triton_gemv.py "unit", triton_int4_mma.py) spend 2.3 to 4 SASS instructions a weight
turning nibbles into floats and multiplying them; issue-bound, they read gate/up at about half of copy bandwidth
(docs/BENCHMARKS.md). Here x is first put in 16-bit fixed point per 32-input block (a small kernel of its own),
and `dp4a` multiplies four nibbles by four bytes of x and adds the products in one instruction, exactly, as
llama.cpp's CUDA kernels multiply Q4 blocks by 8-bit x. Two bytes of x (a signed high byte, an unsigned low byte)
keep 16 bits instead of llama.cpp's 8.

The fixed point (quant_ref.quantize_x is its definition and the kernels' twin): a block's scale d is the power of
two for which its largest |x| / d lies in [2^14, 2^15); xq = x / d rounded (ties away from zero) and clamped to
int16, xq = 256 hi + lo. A bf16 x has 8 significant bits, so every element at least 1/128 of its block's largest
is exact, and a smaller one is off by at most d / 2 (2^-15 of that largest). The block's float sum of x goes beside it, for the groups' mins.

A 32-bit word of the packing holds bytes i..i+3 of a 32-input block: inputs i..i+3 in its low nibbles, i+16..i+19
in its high ones. `w & 0x0F0F0F0F` gives the low nibbles as bytes, `w & 0xF0F0F0F0` the high ones times 16, and
x's bytes for those inputs are one word of each plane. A block (4 words, one thread's 16-byte load) is 8 LOP3 and
16 dp4a into 4 sums, P and R of the low nibbles against the high and low plane, Q and S of the high ones; 4096 P +
256 Q + 16 R + S = 16 sum(q xq), below 2^28. Per (row, block): y += sum(q xq) * (s * d) + m * sum(x), with the
group's scale s and min m. K is split over programs as in the GEMV, the last program to arrive adding the partial
sums in split order. x is padded with zero blocks to whole loop trips, and weights past a row read its last block
again, so no load in the loop carries a mask.

Status: compiled for sm_90 offline (Triton 3.6, the default tile: 128 rows x 8 blocks, 4 warps, 128 registers;
~1.5 SASS instructions a weight in the main loop, against ~2.3 for the tensor-core kernel and ~3.6 for "unit"),
not yet run on a GPU. quant_linear takes it only with TOKENMILL_INT4_IDOT=1 (enabled()) until a GPU run shows it
correct and faster."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_arrive import counters
from tokenmill.kernels.triton_gemv import _store_rows, num_sms, one_row
from tokenmill.kernels.triton_pdl import pdl_args, pdl_release, pdl_wait
from tokenmill.kernels.quant_ref import X_BLOCK

XQ_BLOCKS = 4  # blocks a program of the x kernel converts
IDOT_ENV = "TOKENMILL_INT4_IDOT"


@dataclass(frozen=True)
class IdotConfig:
    block_n: int = 128  # rows a program
    blocks: int = 8  # 32-input blocks a row a loop trip (a row's 16-byte words along the trip)
    num_warps: int = 4
    programs_per_sm: int = 4
    split_k: int = 0  # 0: split K until there are about programs_per_sm programs a multiprocessor
    early: bool = True  # the first weights load before the PDL wait (no kernel of a step writes them)

    def __post_init__(self) -> None:
        for name in ("block_n", "blocks"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"IdotConfig.{name} must be a power of two, got {value}")


IDOT_CFG = IdotConfig()


@triton.jit
def _quantize_x_kernel(x_ptr, xq_ptr, meta_ptr, K, KB, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """BLOCKS blocks of x into the fixed point: high bytes at xq_ptr[0, KB * 32), low bytes after them, then d
    [KB] and the sums [KB] as float32 at meta_ptr. Blocks past x are zeros."""
    pdl_wait(PDL)  # x is the kernel before's output
    pdl_release(PDL)
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    k = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    exp = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(exp - 14, 1)
    d = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    v = x * inv[:, None]
    xq = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))  # ties away from zero, as every quantizer here
    xq = tl.minimum(tl.maximum(xq, -32768.0), 32767.0).to(tl.int32)
    b_mask = b < KB
    k_mask = b_mask[:, None]
    tl.store(xq_ptr + k, (xq >> 8).to(tl.int8), mask=k_mask)
    tl.store(xq_ptr + KB * 32 + k, (xq & 255).to(tl.uint8).to(tl.int8, bitcast=True), mask=k_mask)
    tl.store(meta_ptr + b, d, mask=b_mask)
    tl.store(meta_ptr + KB + b, tl.sum(x, 1), mask=b_mask)


@triton.jit
def _idot_block(w, xhl, xhh, xll, xlh):
    """A block's 4 packed words w (4 consecutive elements of a thread) against x's words: xhl / xhh the high bytes
    of x at the low / high nibbles' inputs, xll / xlh the low bytes. Out: 4096 P, 256 Q, 16 R and S (module
    doc), whose sum is 16 sum(q xq) over the block. dp4a.u32.s32: unsigned nibbles times signed high bytes."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 l, h, p, q, r, s;
        and.b32 l, $4, 0x0F0F0F0F;
        and.b32 h, $4, 0xF0F0F0F0;
        dp4a.u32.s32 p, l, $8, 0;
        dp4a.u32.s32 q, h, $12, 0;
        dp4a.u32.u32 r, l, $16, 0;
        dp4a.u32.u32 s, h, $20, 0;
        and.b32 l, $5, 0x0F0F0F0F;
        and.b32 h, $5, 0xF0F0F0F0;
        dp4a.u32.s32 p, l, $9, p;
        dp4a.u32.s32 q, h, $13, q;
        dp4a.u32.u32 r, l, $17, r;
        dp4a.u32.u32 s, h, $21, s;
        and.b32 l, $6, 0x0F0F0F0F;
        and.b32 h, $6, 0xF0F0F0F0;
        dp4a.u32.s32 p, l, $10, p;
        dp4a.u32.s32 q, h, $14, q;
        dp4a.u32.u32 r, l, $18, r;
        dp4a.u32.u32 s, h, $22, s;
        and.b32 l, $7, 0x0F0F0F0F;
        and.b32 h, $7, 0xF0F0F0F0;
        dp4a.u32.s32 p, l, $11, p;
        dp4a.u32.s32 q, h, $15, q;
        dp4a.u32.u32 r, l, $19, r;
        dp4a.u32.u32 s, h, $23, s;
        shl.b32 $0, p, 12;
        shl.b32 $1, q, 8;
        shl.b32 $2, r, 4;
        mov.b32 $3, s;
        }""",
        constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r", args=[w, xhl, xhh, xll, xlh], dtype=tl.int32,
        is_pure=True, pack=4)


@triton.jit
def _word_tile(rows, j0, KB, BLOCKS: tl.constexpr):
    """The [BLOCK_N, BLOCKS * 4] packed words of the BLOCKS blocks from j0, unmasked: blocks past the row read its
    last one again (x is zero there), so no load carries a mask."""
    col = tl.arange(0, BLOCKS * 4)[None, :]
    jj = tl.minimum(j0 + col // 4, KB - 1)
    return tl.load(rows + jj * 4 + col % 4)


@triton.jit
def _idot_tile(part, w, j0, KB, KBP, xq_ptr, meta_ptr, s_ptr, m_ptr, s_rows, x_col, blk,
               GROUP_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):
    """part + the tile w of blocks j0.. . x holds KBP blocks, zeros from KB on, so no load carries a mask: a tile
    past the row adds zeros."""
    xw = xq_ptr + j0 * 8 + x_col
    xhl = tl.load(xw)
    xhh = tl.load(xw + 4)
    xll = tl.load(xw + KBP * 8)
    xlh = tl.load(xw + KBP * 8 + 4)
    t = tl.sum(tl.reshape(_idot_block(w, xhl, xhh, xll, xlh), [BLOCK_N, BLOCKS, 4]), 2, keep_dims=True)
    jj = j0 + blk
    d = tl.load(meta_ptr + jj)
    xsum = tl.load(meta_ptr + KBP + jj)
    g = tl.minimum(jj, KB - 1) // GROUP_BLOCKS
    s = tl.load(s_ptr + s_rows + g).to(tl.float32)
    m = tl.load(m_ptr + s_rows + g).to(tl.float32)
    return part + t.to(tl.float32) * (s * (d * 0.0625)) + m * xsum


@triton.jit
def _idot_kernel(xq_ptr, meta_ptr, w_ptr, s_ptr, m_ptr, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr,
                 N, KB, KBP, blocks_per_split, stride_wn, stride_sn,
                 GROUP_BLOCKS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, EARLY: tl.constexpr,
                 PDL: tl.constexpr):
    """xq_ptr: x's fixed point as int32 words (high plane, then low plane, KBP blocks each: KB rounded up to whole
    trips); w_ptr: the weight as int32 words, stride_wn words a row. A trip's tile is [rows, words] (a row's BLOCKS * 16 bytes are contiguous), its block
    sums [rows, blocks, 1]. Rows past N read row N - 1 (never stored)."""
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.minimum(offs_n, N - 1).to(tl.int64)
    rows = w_ptr + row[:, None] * stride_wn
    s_rows = row[:, None, None] * stride_sn
    col = tl.arange(0, BLOCKS * 4)[None, :]
    x_col = (col // 4) * 8 + col % 4  # a block's 32 bytes of a plane: words 0-3 its inputs 0-15, 4-7 inputs 16-31
    blk = tl.arange(0, BLOCKS)[None, :, None]
    j_lo = pid_k * blocks_per_split
    j_hi = tl.minimum(j_lo + blocks_per_split, KB)
    if not EARLY:
        pdl_wait(PDL)
    nxt = _word_tile(rows, j_lo, KB, BLOCKS)
    if EARLY:
        pdl_wait(PDL)
    # zeros in the layout of the block sums (a plain tl.zeros takes another, converted at every trip)
    part = tl.sum(tl.reshape(nxt, [BLOCK_N, BLOCKS, 4]), 2, keep_dims=True).to(tl.float32) * 0.0
    # two tiles a trip in alternating registers: each loads while the other is summed, and nothing is copied
    for j0 in range(j_lo, j_hi, 2 * BLOCKS):
        odd = _word_tile(rows, j0 + BLOCKS, KB, BLOCKS)
        part = _idot_tile(part, nxt, j0, KB, KBP, xq_ptr, meta_ptr, s_ptr, m_ptr, s_rows, x_col, blk, GROUP_BLOCKS,
                          BLOCK_N, BLOCKS)
        if j0 + 2 * BLOCKS < j_hi:  # no prefetch past the split: its bytes would be read for nothing
            nxt = _word_tile(rows, j0 + 2 * BLOCKS, KB, BLOCKS)
        part = _idot_tile(part, odd, j0 + BLOCKS, KB, KBP, xq_ptr, meta_ptr, s_ptr, m_ptr, s_rows, x_col, blk,
                          GROUP_BLOCKS, BLOCK_N, BLOCKS)
    pdl_release(PDL)
    y = tl.sum(tl.sum(part, 2), 1)
    _store_rows(y, 0.0, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr, offs_n, N, 0, 0.0, HAS_BIAS, HAS_RESIDUAL,
                False, SPLIT)


@functools.lru_cache
def enabled() -> bool:
    """Whether quant_linear runs one INT4 row here: off unless TOKENMILL_INT4_IDOT=1, until a GPU run measures it
    against the float kernels (written and compiled for sm_90 offline, never run on a GPU yet)."""
    value = os.environ.get(IDOT_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{IDOT_ENV}={value!r} is not supported; allowed: 0, 1")
    return value == "1"


def supports(x: torch.Tensor, qweight: torch.Tensor, group: int) -> bool:
    """Whether int4_idot_gemv takes this call: one row of bf16 or fp16 x on an NVIDIA GPU of compute capability
    6.1 or later (dp4a), a packed weight whose base and rows are 16-byte aligned (read as 16-byte words)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and torch.version.hip is None
            and qweight.dtype == torch.uint8 and qweight.stride(-1) == 1 and qweight.stride(0) % 16 == 0
            and qweight.data_ptr() % 16 == 0 and group % X_BLOCK == 0
            and torch.cuda.get_device_capability(x.device) >= (6, 1))


def int4_idot_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                   in_features: int, group: int, bias: torch.Tensor | None = None,
                   config: IdotConfig | None = None, *, residual: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """quant_linear (triton_quant.py) for one row of x (supports()): two launches, x's fixed point then the
    integer GEMV."""
    cfg = config or IDOT_CFG
    k, n = in_features, qweight.shape[0]
    if x.numel() != k:
        raise ValueError(f"int4_idot_gemv takes one row of {k} inputs, got x of shape {tuple(x.shape)}")
    kb = triton.cdiv(k, X_BLOCK)
    if qweight.shape[1] * 2 < kb * X_BLOCK:
        raise ValueError(f"packed weight rows hold {qweight.shape[1] * 2} inputs, fewer than {kb * X_BLOCK}")
    x1, residual = one_row(x, k, residual, n)
    pdl = pdl_args(x)
    kbp = triton.cdiv(kb, 2 * cfg.blocks) * 2 * cfg.blocks  # whole trips of two tiles: no load needs a mask
    buf = torch.empty(kbp * (2 * X_BLOCK + 8), dtype=torch.int8, device=x.device)
    meta = buf[2 * kbp * X_BLOCK:].view(torch.float32)
    _quantize_x_kernel[(triton.cdiv(kbp, XQ_BLOCKS),)](x1, buf, meta, k, kbp, BLOCKS=XQ_BLOCKS, num_warps=1, **pdl)
    out = torch.empty(n, dtype=out_dtype or x.dtype, device=x.device)
    row_tiles = triton.cdiv(n, cfg.block_n)
    trips = triton.cdiv(kb, cfg.blocks)
    split = cfg.split_k or max(1, min(triton.cdiv(cfg.programs_per_sm * num_sms(x.device.index or 0), row_tiles),
                                      trips, 32))
    blocks_per_split = triton.cdiv(triton.cdiv(trips, 2), min(split, trips)) * 2 * cfg.blocks  # whole trips of two tiles
    split = triton.cdiv(kb, blocks_per_split)
    part = torch.empty(split * n, dtype=torch.float32, device=x.device) if split > 1 else out
    counter = counters(x.device, row_tiles) if split > 1 else out
    _idot_kernel[(row_tiles, split)](
        buf[:2 * kbp * X_BLOCK].view(torch.int32), meta, qweight.view(torch.int32), scales, mins,
        out if bias is None else bias, out if residual is None else residual, out, part, counter,
        n, kb, kbp, blocks_per_split, qweight.stride(0) // 4, scales.stride(0),
        GROUP_BLOCKS=group // X_BLOCK, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        SPLIT=split > 1, BLOCK_N=cfg.block_n, BLOCKS=cfg.blocks, EARLY=cfg.early, num_warps=cfg.num_warps,
        num_stages=1, **pdl)
    return out.view(*x.shape[:-1], n)
