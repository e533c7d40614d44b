"""FP8 (e4m3) weights times a decode batch's e4m3 rows on the tensor cores with the operands swapped: y^T = W x^T.

Why: wgmma's M is 64 rows a warpgroup, and in x W^T that M is the batch. The tile kernel (triton_quant.py) pads
17 rows to 64 (three quarters of its products on zero rows, its accumulators and shared memory sized for them)
and below 17 rows converts e4m3 to fp16 for mma.sync. Swapped, a weight tile's output channels fill M and the
batch's rows wgmma's N (16 to 64, a power of two), so both operands go from shared memory into wgmma as they
were loaded, e4m3, and a program holds only the rows that exist. Decode reads every weight once a step, so what
counts is bytes in flight: K is split over programs until the grid fills the GPU (SkinnyConfig.programs_per_sm),
and the split that finishes last adds the float32 partial sums in split order (triton_arrive.py).

Arithmetic is the tile kernel's e4m3 path: exact e4m3 products, partial sums moved into float32 every 128 inputs
(or, with fast_accum, wgmma's own accumulator over the whole K), times W's channel scale and x's row scale at
the end, then bias and residual in float32 and one rounding to the output dtype."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_arrive import arrive_last, counters, merged
from tokenmill.kernels.triton_gemv import WIDE_N, num_sms, store_tile
from tokenmill.kernels.triton_pdl import pdl_args, pdl_release, pdl_wait

MAX_ROWS = 64  # past 64 rows the tile kernel (o, down) and cuBLAS's FP8 GEMM (qkv, gate/up) win (BENCHMARKS)
PROMOTE_EVERY = 128  # inputs summed in wgmma's accumulator before they move into float32 (without fast_accum)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64  # output channels a program (wgmma's M: 64 a warpgroup)
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 5
    programs_per_sm: int = 1  # K is split until the grid has about this many programs a multiprocessor
    fast_accum: bool = False

    def __post_init__(self) -> None:
        if self.block_n < 64 or self.block_n & (self.block_n - 1):
            raise ValueError(f"SkinnyConfig.block_n must be a power of two of at least 64, got {self.block_n}")
        if self.block_k < PROMOTE_EVERY or self.block_k & (self.block_k - 1):
            raise ValueError(f"SkinnyConfig.block_k must be a power of two of at least {PROMOTE_EVERY}, "
                             f"got {self.block_k}")
        if self.programs_per_sm < 1:
            raise ValueError(f"SkinnyConfig.programs_per_sm must be at least 1, got {self.programs_per_sm}")


# The best of a search on the H200 (docs/BENCHMARKS.md, 2026-12-03: tiles 64 / 128 / 256 wide, K tiles 128 / 256,
# 3-5 stages, 1 / 2 / 4 programs a multiprocessor; Llama-3-8B's four matrices at 2 to 128 rows): 64 channels a
# program, the split that gives the grid about one program a multiprocessor, five stages; a matrix of WIDE_N
# outputs or more (gate/up: 448 programs unsplit) three.
NARROW = SkinnyConfig()
WIDE = SkinnyConfig(num_stages=3)


def default_config(n: int) -> SkinnyConfig:
    return WIDE if n >= WIDE_N else NARROW


def takes(m: int, n: int, k: int, out_dtype: torch.dtype) -> bool:
    """Whether skinny_mm serves an FP8 product of m rows: 2 to MAX_ROWS of them, 16-bit output (float32
    logits keep the tile kernel's float16 dots, which sum in more bits), and rows of 16-byte multiples (the
    operands' loads into shared memory)."""
    return 2 <= m <= MAX_ROWS and out_dtype in (torch.bfloat16, torch.float16) and k % 16 == 0


@triton.jit
def _skinny_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr,
                   M, N, K, k_per_split, stride_xm, stride_wn, stride_sn, stride_om, stride_split,
                   HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr,
                   FAST_ACCUM: tl.constexpr, PROMOTE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One (BLOCK_N channels, split of K) program over all M rows: acc^T [BLOCK_N, BLOCK_M] = W x^T."""
    pdl_wait(PDL)  # x and its scales are the quantization kernel's output
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):  # K tiles past K are masked off (the last split's)
        kk = k0 + offs_k
        k_ok = (kk < K)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
        if FAST_ACCUM:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
    pdl_release(PDL)  # the next kernel's programs wait beside this one's epilogue, not its main loop
    acc = acc * tl.load(ws_ptr + offs_n.to(tl.int64) * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    acc = tl.trans(acc * tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)[None, :])  # [BLOCK_M, BLOCK_N], as out
    out_mask = m_ok[:, None] & n_ok[None, :]
    out_off = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if SPLITS > 1:
        tl.store(part_ptr + pid_k * stride_split + out_off, acc, mask=out_mask)
        if arrive_last(counter_ptr + pid_n, SPLITS):
            acc = merged(part_ptr + out_off, stride_split, out_mask, SPLITS, SPLITS)
            store_tile(acc, b_ptr, r_ptr, out_ptr, out_off, offs_n, N, out_mask, HAS_BIAS, HAS_RESIDUAL)
    else:
        store_tile(acc, b_ptr, r_ptr, out_ptr, out_off, offs_n, N, out_mask, HAS_BIAS, HAS_RESIDUAL)


def splits_for(cfg: SkinnyConfig, n: int, k: int, device: torch.device) -> int:
    """K splits of cfg's grid: enough for about programs_per_sm programs a multiprocessor, at most 16, never
    fewer than one K tile a split."""
    tiles = triton.cdiv(n, cfg.block_n)
    target = cfg.programs_per_sm * num_sms(device.index or 0)
    return max(1, min(triton.cdiv(target, tiles), triton.cdiv(k, cfg.block_k), 16))


def skinny_mm(xq: torch.Tensor, x_scales: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor,
              bias: torch.Tensor | None, residual: torch.Tensor | None, out_dtype: torch.dtype,
              cfg: SkinnyConfig | None = None) -> torch.Tensor:
    """(xq * x_scales) @ (qweight * w_scales).T (+ bias, + residual) in out_dtype for the rows takes() accepts:
    xq [M, K] e4m3 with float32 scales [M] (triton_fp8_linear.quantize_rows), qweight [N, K] e4m3 with float32
    channel scales [N, 1]; cfg default_config's for N."""
    m, k = xq.shape
    n = qweight.shape[0]
    cfg = cfg or default_config(n)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    k_tiles = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(k_tiles, splits_for(cfg, n, k, xq.device)) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=xq.device) if splits > 1 else out
    grid = (triton.cdiv(n, cfg.block_n), splits)
    counter = counters(xq.device, grid[0]) if splits > 1 else out
    _skinny_kernel[grid](
        xq, x_scales, qweight, w_scales, out if bias is None else bias, out if residual is None else residual,
        out, part, counter, m, n, k, k_per_split, xq.stride(0), qweight.stride(0), w_scales.stride(0), n, m * n,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, SPLITS=splits,
        FAST_ACCUM=cfg.fast_accum, PROMOTE=PROMOTE_EVERY, BLOCK_N=cfg.block_n,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(xq))
    return out
