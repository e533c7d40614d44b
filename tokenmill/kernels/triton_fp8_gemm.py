"""FP8 (e4m3 x e4m3) GEMM for decode batches, its operands read by TMA copies: out = (xq * x_scales) @ (W *
w_scales).T (+ bias, + residual), bf16 or fp16 out, K split over programs with the last one to arrive adding the
partial sums (triton_arrive.py).

Why: at decode batch sizes the weight is read once a step and the products are cheap, so the matmul should run
near copy bandwidth; cuBLAS's FP8 GEMM, which does not split K, covers o and down (4,096 outputs) with 32-64
tiles of 128 x 128 on 132 multiprocessors, and triton_quant's tile kernel (masked pointer loads through
cp.async) at 193-256 rows was slower still (docs/BENCHMARKS.md). Here the tiles come in by TMA (no masks: rows past M and K are zeros),
Triton pipelines them num_stages deep, and K is split until about `programs_per_sm` programs a multiprocessor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tokenmill.kernels.triton_arrive import counters
from tokenmill.kernels.triton_gemv import num_sms
from tokenmill.kernels.triton_pdl import pdl_args, pdl_release, pdl_wait
from tokenmill.kernels.triton_tiles import finish_tile, tile_coords


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 1  # K is split until the grid has about this many programs a multiprocessor
    fast_accum: bool = True  # cuBLAS's and the engine's: wgmma's accumulator over the whole of K
    group_m: int = 8

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1) or value > 256:
                raise ValueError(f"Fp8GemmConfig.{name} must be a power of two in [16, 256] (a TMA copy's "
                                 f"side), got {value}")


# the search's best at 192 and 256 rows on the H200 for o and down (docs/BENCHMARKS.md)
DECODE_CFG = Fp8GemmConfig(64, 64, 128, num_warps=4, num_stages=6)


@triton.jit
def _fp8_gemm_kernel(x_desc, w_desc, xs_ptr, ws_ptr, b_ptr, r_ptr, out_ptr, part_ptr, counter_ptr,
                     M, N, K, k_tiles_per_split, stride_om, stride_split,
                     HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr,
                     FAST_ACCUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # x is the kernel before's output
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    t_lo = pid_k * k_tiles_per_split
    t_hi = tl.minimum(t_lo + k_tiles_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for t in range(t_lo, t_hi):
        x = x_desc.load([m0, t * BLOCK_K])
        w = w_desc.load([n0, t * BLOCK_K])
        if FAST_ACCUM:
            acc = tl.dot(x, w.T, acc)
        else:  # the partial sums leave wgmma's narrower accumulator every BLOCK_K inputs
            acc = tl.dot(x, w.T, acc, max_num_imprecise_acc=BLOCK_K)
    pdl_release(PDL)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    acc = acc * tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    acc = acc * tl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_off = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    finish_tile(acc, tile, pid_k, part_ptr, counter_ptr, stride_split, b_ptr, r_ptr, out_ptr, out_off, offs_n, N,
                out_mask, HAS_BIAS, HAS_RESIDUAL, SPLIT)


def supports(xq: torch.Tensor, qweight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """e4m3 x and W with contiguous rows at 16-byte aligned addresses (TMA's), K a multiple of 16, 16-bit output,
    an sm_90+ NVIDIA GPU (TMA)."""
    return (xq.dtype == qweight.dtype == torch.float8_e4m3fn and xq.is_cuda and torch.version.hip is None
            and out_dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(xq.device)[0] >= 9
            and xq.stride(-1) == 1 and qweight.stride(-1) == 1 and xq.stride(0) % 16 == 0
            and qweight.stride(0) % 16 == 0 and xq.data_ptr() % 16 == 0 and qweight.data_ptr() % 16 == 0
            and xq.shape[1] % 16 == 0)


def split_tiles(m: int, n: int, k: int, cfg: Fp8GemmConfig, sms: int) -> int:
    """K tiles a program: K split until the grid has about programs_per_sm programs a multiprocessor (at most 16
    splits), in whole BLOCK_K tiles."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    k_tiles = triton.cdiv(k, cfg.block_k)
    splits = max(1, min(triton.cdiv(cfg.programs_per_sm * sms, tiles), k_tiles, 16))
    return triton.cdiv(k_tiles, splits)


def fp8_gemm(xq: torch.Tensor, x_scales: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor,
             bias: torch.Tensor | None, residual: torch.Tensor | None, out_dtype: torch.dtype,
             cfg: Fp8GemmConfig) -> torch.Tensor:
    """xq [M, K] e4m3 with float32 scales a row, qweight [N, K] e4m3 with scales a row -> [M, N] in out_dtype, as
    triton_quant.quant_linear's FP8 path computes it (supports() says where)."""
    m, k = xq.shape
    n = qweight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    k_tiles = split_tiles(m, n, k, cfg, num_sms(xq.device.index or 0))
    splits = triton.cdiv(triton.cdiv(k, cfg.block_k), k_tiles)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=xq.device) if splits > 1 else out
    counter = counters(xq.device, tiles) if splits > 1 else out
    x_desc = TensorDescriptor.from_tensor(xq, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(qweight, [cfg.block_n, cfg.block_k])
    _fp8_gemm_kernel[(tiles, splits)](
        x_desc, w_desc, x_scales, w_scales.view(-1), out if bias is None else bias,
        out if residual is None else residual, out, part, counter, m, n, k, k_tiles, n, m * n,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, SPLIT=splits > 1, FAST_ACCUM=cfg.fast_accum,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(xq))
    return out
