"""Quantized-weight matmul in Triton: y = x @ W.T + b (+ a residual, added in the store) with W packed INT8 or
INT4 (tokenmill/quant/formats.py), dequantized tile by tile in registers; no dequantized copy of W ever exists
in memory.

INT4 with bf16 x of 2 to 16 rows (and one row of a wide or deep matrix) goes to the tensor-core decode kernel of
triton_int4_mma.py; any other single row to the GEMV of triton_gemv.py. FP8 (e4m3 weights) quantizes x row by
row first (triton_fp8_linear.py); 2 to 64 rows of 16-bit output go to the swapped-operand kernel of
triton_fp8_skinny.py; otherwise from 17 rows its tiles multiply e4m3 by e4m3 on the tensor cores, and where
cuBLAS's 128 x 128 tiles fill the GPU (bf16 output) its FP8 GEMM runs instead. Otherwise one kernel, two tile shapes.
Decode (M <= 16 rows): a 16-row tile, narrow N tiles and long K tiles. Larger M: classic square-ish tiles, the
row tiles of one weight tile side by side (_tile_coords).
Either way, when the tiles are too few to fill the GPU the K loop is split over programs, and the split that
finishes last adds the fp32 partial sums in split order (triton_arrive.py), so results are deterministic.

A K tile is cut into sub-tiles of one input group each (group_param). INT4 sub-tiles are handled in halves
that match the packing: the byte at column i of a sub-tile holds input (i // 16) * 32 + i % 16 (low nibble) and
that input + 16 (high nibble), so a sub-tile is two dots, one per nibble, against two x tiles loaded at those
columns. Per-channel INT8 scales the accumulator once at the end.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels import quant_ref, triton_activation, triton_fp8_linear, triton_fp8_skinny, triton_int4_mma
from tokenmill.kernels.triton_arrive import arrive_last, counters, merged
from tokenmill.kernels.triton_gemv import (
    WIDE_N,
    group_param,
    int4_subtile,
    num_sms,
    quant_gemv,
    store_tile,
    sub_tile,
)
from tokenmill.kernels.triton_pdl import pdl_args, pdl_release, pdl_wait


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # INT4 only: nibbles become floats by setting them as the low mantissa bits of a power of two whose ulp is 1
    # (then subtracting it): no int-to-float conversion per weight (float16 inputs also apply scale and min in
    # float16). Off until measured on a GPU (`python -m tokenmill.quant.bench --tune` times both).
    bit_dequant: bool = False
    # FP8 on tensor cores only: accumulate a whole K loop in wgmma's accumulator (cuBLAS's "fast accumulation",
    # fewer bits kept) instead of moving the partial sums into float32 every sub-tile
    fast_accum: bool = False
    group_m: int = 8  # row tiles that share one weight tile run side by side (_tile_coords)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):  # tl.dot needs 16 or more; INT4 halves of block_k too
                raise ValueError(f"MatmulConfig.{name} must be a power of two of at least 16, got {value}")
        if self.block_k < 32:
            raise ValueError(f"MatmulConfig.block_k must be at least 32 (a packing block of INT4), got {self.block_k}")


# `python -m tokenmill.quant.bench --tune` searches tile shapes. SKINNY was its best at M = 1 on the H200 (4096 x
# 14336: INT8 22.1 us against 23.0 for the first guess; INT4 g128 31.6 against 34.2), before one row went to the
# GEMV; it now serves M = 2..16 (INT8, and INT4 with float16 or float32 x: bf16 INT4 takes triton_int4_mma.py) and
# has not been re-tuned there. Beyond 16 rows, `--tune`'s grid over Llama-3-8B's four matrices at 64, 512 and 2,048
# rows on an H100 (docs/BENCHMARKS.md, 2026-12-07): GEMM_LARGE was the faster for INT4 at every row count (a
# 512-token prefill 2.2 times as fast as on GEMM). INT8 gains from it only once its tiles fill the GPU more than
# GEMM_LARGE_WAVES times over: on the H200, gate/up (224 tiles a 128 rows) lost 13% at 128 rows and won 22% at 256;
# down, qkv and o at 512 rows (128-192 tiles) tied or lost up to 16%; all four won at 2,048 on the H100 (512-1,792 tiles).
SKINNY_M = 16
SKINNY = MatmulConfig(16, 32, 256, num_warps=4, num_stages=4)
GEMM = MatmulConfig(64, 128, 128, num_warps=8, num_stages=3)
GEMM_LARGE = MatmulConfig(128, 128, 64, num_warps=8, num_stages=4)
GEMM_LARGE_WAVES = 2  # INT8 takes GEMM_LARGE from more tiles than this many per multiprocessor; INT4 beyond SKINNY_M
# FP8 beyond 16 rows multiplies e4m3 by e4m3 on the tensor cores (FP8_DOT_MIN_M rows a tile at least: wgmma's)
# where cuBLAS's FP8 GEMM is slower (triton_fp8_linear.use_scaled_mm); (most rows, config) by rows, the best of
# `python -m tokenmill.quant.bench --fp8-gemm --tune` on the H200 (docs/BENCHMARKS.md, 2026-12-02). float32
# output (a quantized LM head's logits) keeps float16 dots: wgmma sums e4m3 products in fewer bits than float32's
# between its promotions into the float32 accumulator.
FP8_DOT_MIN_M = 64
FP8_GEMM = ((64, MatmulConfig(64, 64, 128, num_warps=4, num_stages=3)),
            (192, MatmulConfig(64, 64, 128, num_warps=4, num_stages=4)),
            (512, MatmulConfig(64, 64, 128, num_warps=4, num_stages=3)),
            (None, MatmulConfig(128, 64, 128, num_warps=8, num_stages=4)))
FP8_WIDE = MatmulConfig(64, 128, 128, num_warps=4, num_stages=4)  # 129-192 rows of WIDE_N outputs or more: gate/up


@triton.jit
def _nibble_to_float(nib, DTYPE: tl.constexpr, BIT_TRICK: tl.constexpr):
    """Integers 0..15 as DTYPE (float16 or float32). BIT_TRICK: without a conversion instruction, by ORing them
    into the mantissa of 1024 (float16) or 2^23 (float32), where the ulp is 1, and subtracting that power of two."""
    if not BIT_TRICK:
        return nib.to(DTYPE)
    elif DTYPE == tl.float16:
        return (nib.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    else:
        return (nib.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _quant_matmul_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, m_ptr, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr,
                         M, N, K, n_groups, k_per_split,
                         stride_xm, stride_wn, stride_sn, stride_om, stride_split,
                         INT4: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr,
                         UNROLLED_SPLITS: tl.constexpr, PRECISION: tl.constexpr, FP8_DOT: tl.constexpr,
                         FAST_ACCUM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SUB: tl.constexpr, BIT_DEQUANT: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # x is the kernel before's output
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = (offs_m < M)[:, None]
    n_mask = (offs_n < N)[:, None]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_off = offs_n.to(tl.int64)[:, None] * stride_sn
    if FP8_DOT:  # e4m3 operands on the tensor cores (wgmma on sm_90)
        dt = tl.float8e4nv
    else:  # e4m3 values are exact in fp16 (one cvt a pair on sm_90)
        dt = tl.float16 if FP8 else x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = k_lo + k_per_split  # tiles past K are masked off; only the last split has any
    if INT4:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            for j in tl.static_range(BLOCK_K // SUB):
                ks = k0 + j * SUB
                packed, kl, kh = int4_subtile(w_rows, n_mask, ks, K, SUB // 2)
                if BIT_DEQUANT and dt == tl.float16:  # float16 scales and mins are exact in float16 arithmetic
                    scale = group_param(s_ptr, s_off, n_mask, ks, n_groups, GROUP, dt)
                    low = group_param(m_ptr, s_off, n_mask, ks, n_groups, GROUP, dt)
                    w_lo = _nibble_to_float(packed & 15, dt, True) * scale + low
                    w_hi = _nibble_to_float(packed >> 4, dt, True) * scale + low
                else:  # float32 arithmetic, one rounding to the compute dtype
                    scale = group_param(s_ptr, s_off, n_mask, ks, n_groups, GROUP)
                    low = group_param(m_ptr, s_off, n_mask, ks, n_groups, GROUP)
                    w_lo = (_nibble_to_float(packed & 15, tl.float32, BIT_DEQUANT) * scale + low).to(dt)
                    w_hi = (_nibble_to_float(packed >> 4, tl.float32, BIT_DEQUANT) * scale + low).to(dt)
                x_lo = tl.load(x_rows + kl[None, :], mask=m_mask & (kl < K)[None, :], other=0.0)
                x_hi = tl.load(x_rows + kh[None, :], mask=m_mask & (kh < K)[None, :], other=0.0)
                acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
                acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=PRECISION)
    else:
        offs_k = tl.arange(0, SUB)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            for j in tl.static_range(BLOCK_K // SUB):
                kk = k0 + j * SUB + offs_k
                if FP8:
                    q = tl.load(w_rows + kk[None, :], mask=n_mask & (kk < K)[None, :], other=0.0)
                else:
                    q = tl.load(w_rows + kk[None, :], mask=n_mask & (kk < K)[None, :], other=0)
                if PER_CHANNEL:
                    w = q.to(dt)  # |q| <= 127 is exact in every float type; the scale is applied at the end
                else:
                    scale = group_param(s_ptr, s_off, n_mask, k0 + j * SUB, n_groups, GROUP)
                    w = (q.to(tl.float32) * scale).to(dt)
                x = tl.load(x_rows + kk[None, :], mask=m_mask & (kk < K)[None, :], other=0.0).to(dt)
                if FP8_DOT and not FAST_ACCUM:  # the partial sums leave wgmma's narrower accumulator every sub-tile
                    acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=SUB)
                else:
                    acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if PER_CHANNEL:
            acc = acc * tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if FP8:  # x's row scales
            acc = acc * tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    pdl_release(PDL)  # the next kernel's programs wait beside this one's epilogue, not its main loop
    out_mask = m_mask & (offs_n < N)[None, :]
    out_off = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if SPLIT:  # the split that finishes last adds the partial sums in split order (triton_arrive.py)
        tl.store(part_ptr + pid_k * stride_split + out_off, acc, mask=out_mask)
        if arrive_last(counter_ptr + tile, tl.num_programs(1)):
            acc = merged(part_ptr + out_off, stride_split, out_mask, tl.num_programs(1), UNROLLED_SPLITS)
            store_tile(acc, b_ptr, r_ptr, out_ptr, out_off, offs_n, N, out_mask, HAS_BIAS, HAS_RESIDUAL)
    else:
        store_tile(acc, b_ptr, r_ptr, out_ptr, out_off, offs_n, N, out_mask, HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of a program: GROUP_M row tiles of one column tile run side by side, so the
    weight tile they share is read from memory once and from L2 by the others."""
    num_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % rows, (tile % per_group) // rows


def pick_config(m: int, n: int, k: int, device: torch.device, fp8: bool = False, int4: bool = False) -> MatmulConfig:
    """The skinny config for decode-sized M, a GEMM config (FP8: FP8_GEMM's for M) otherwise; K is split over
    programs until there are about two per multiprocessor (a batch of 64 rows of a 4096-wide output is only 32
    GEMM tiles: unsplit, it ran on a quarter of the H200 at a tenth of bf16's speed)."""
    if m <= SKINNY_M:
        cfg = SKINNY
    elif fp8 and 128 < m <= 192 and n >= WIDE_N:
        cfg = FP8_WIDE
    elif fp8:
        cfg = next(c for most, c in FP8_GEMM if most is None or m <= most)
    else:
        cfg = GEMM_LARGE if int4 or _fills_waves(GEMM_LARGE, m, n, device) else GEMM
    return with_split(cfg, m, n, k, device)


def _num_tiles(cfg: MatmulConfig, m: int, n: int) -> int:
    return triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)


def _fills_waves(cfg: MatmulConfig, m: int, n: int, device: torch.device) -> bool:
    """Whether cfg's tiles of an m x n output number more than GEMM_LARGE_WAVES a multiprocessor (one on a CPU)."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 1
    return _num_tiles(cfg, m, n) > GEMM_LARGE_WAVES * sms


def with_split(cfg: MatmulConfig, m: int, n: int, k: int, device: torch.device) -> MatmulConfig:
    """cfg with K split over programs until there are about two per multiprocessor (at most 16 splits)."""
    tiles = _num_tiles(cfg, m, n)
    target = 2 * num_sms(device.index or 0) if device.type == "cuda" else 1
    return dataclasses.replace(cfg, split_k=max(1, min(triton.cdiv(target, tiles), triton.cdiv(k, cfg.block_k), 16)))


def _int4_mma_config(x: torch.Tensor, qweight: torch.Tensor, group: int,
                     in_features: int) -> triton_int4_mma.MmaGemvConfig | None:
    """The tensor-core decode kernel's config where it takes this INT4 call and is the faster kernel, else None."""
    if qweight.dtype != torch.uint8 or not triton_int4_mma.supports(x, qweight, group, in_features):
        return None
    return triton_int4_mma.default_config(x.numel() // in_features, qweight.shape[0], in_features,
                                          triton_int4_mma.has_tma(qweight))


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 in_features: int, group: int, bias: torch.Tensor | None,
                 config: MatmulConfig | None = None, *, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, rms_norm: tuple[torch.Tensor, float] | None = None,
                 silu_and_mul: bool = False, silu_and_mul_out: bool = False) -> torch.Tensor:
    """x [..., in_features] @ W.T + bias (+ residual) in out_dtype (default x's), W packed INT8 (int8 qweight) or
    INT4 (uint8); same as quant_ref. Without a config, INT4 with bf16 x of up to 16 rows goes to the tensor-core
    decode kernel (triton_int4_mma.py) where it is the faster one, and any other single row to the GEMV; the tile
    kernel runs the rest (and whatever M is when a config is given). FP8 (float8_e4m3fn qweight) quantizes x too:
    cuBLAS's FP8 GEMM where it is the faster (use_scaled_mm), the tile kernel otherwise; its quantization kernel
    also does the RMSNorm or SiLU·mul that produced x where those are folded in (quant_ref.fp8_activation).
    silu_and_mul_out: W is cat(gate, up) and the result silu(gate) * up: in the tensor-core decode kernel's store
    where it runs (no second kernel, no gate/up in memory), else by the SiLU·mul kernel after the product."""
    if silu_and_mul_out:
        if residual is not None:
            raise ValueError("SiLU·mul of a projection's output takes no residual")
        if config is None and (mma_cfg := _int4_mma_config(x, qweight, group, in_features)) is not None:
            return triton_int4_mma.int4_mma_gemv(x, qweight, scales, mins, in_features, group, bias, mma_cfg,
                                                 out_dtype=out_dtype, silu_and_mul_out=True)
        return triton_activation.silu_and_mul(
            quant_linear(x, qweight, scales, mins, in_features, group, bias, config, out_dtype=out_dtype,
                         rms_norm=rms_norm, silu_and_mul=silu_and_mul))
    int4, fp8 = qweight.dtype == torch.uint8, qweight.dtype == torch.float8_e4m3fn
    if not fp8:
        quant_ref.check_no_prologue(rms_norm, silu_and_mul)
    prologue = {"rms_norm": rms_norm, "silu_and_mul": silu_and_mul}
    x_width = 2 * in_features if silu_and_mul else in_features
    if config is None and (mma_cfg := _int4_mma_config(x, qweight, group, in_features)) is not None:
        return triton_int4_mma.int4_mma_gemv(x, qweight, scales, mins, in_features, group, bias, mma_cfg,
                                             residual=residual, out_dtype=out_dtype)
    if config is None and x.numel() == x_width:
        if fp8:  # x quantized and scaled back to float32 for the GEMV, which scales by W's row scales
            xd, _ = triton_fp8_linear.quantize_rows(x.reshape(1, x_width), dequantize=True, **prologue)
            return quant_gemv(xd, qweight, scales, None, in_features, group, bias, residual=residual,
                              out_dtype=out_dtype or x.dtype).view(*x.shape[:-1], qweight.shape[0])
        return quant_gemv(x, qweight, scales, mins, in_features, group, bias, residual=residual, out_dtype=out_dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x_width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n, k = x2.shape[0], qweight.shape[0], in_features
    out_dtype = out_dtype or x.dtype
    if m == 0:
        return torch.empty(*lead, n, dtype=out_dtype, device=x.device)
    if residual is not None:
        residual = residual.reshape(m, n).contiguous()
    x_scales = None
    if fp8:
        x2, x_scales = triton_fp8_linear.quantize_rows(x2, **prologue)
        if config is None and triton_fp8_linear.use_scaled_mm(m, n, k, out_dtype):
            y = triton_fp8_linear.scaled_mm(x2, x_scales, qweight, scales, bias)
            return (y if residual is None else y.add_(residual)).view(*lead, n)
        if config is None and triton_fp8_skinny.takes(m, n, k, out_dtype):
            return triton_fp8_skinny.skinny_mm(x2, x_scales, qweight, scales, bias, residual, out_dtype).view(*lead, n)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    per_channel = not int4 and group >= k
    cfg = config or pick_config(m, n, k, x.device, fp8, int4)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m), splits)
    counter = counters(x.device, grid[0]) if splits > 1 else out
    _quant_matmul_kernel[grid](
        x2, out if x_scales is None else x_scales, qweight, scales, scales if mins is None else mins,
        out if bias is None else bias, out if residual is None else residual, out, part, counter,
        m, n, k, scales.shape[1], k_per_split,
        x2.stride(0), qweight.stride(0), scales.stride(0), n, m * n,
        INT4=int4, FP8=fp8, GROUP=0 if per_channel else group, PER_CHANNEL=per_channel, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, SPLIT=splits > 1,
        UNROLLED_SPLITS=splits if splits > 1 and cfg.block_m <= SKINNY_M else 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        FP8_DOT=fp8 and cfg.block_m >= FP8_DOT_MIN_M and out_dtype != torch.float32, FAST_ACCUM=cfg.fast_accum,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SUB=sub_tile(0 if per_channel else group, cfg.block_k), BIT_DEQUANT=cfg.bit_dequant and int4,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x))
    return out.view(*lead, n)
