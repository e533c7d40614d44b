"""Pieces shared by the tiled matmul kernels (triton_quant.py's, triton_fp8_gemm.py's): which output tile a program
computes, and how its finished tile is stored or, K split over programs, merged."""
from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.triton_arrive import arrive_last


@triton.jit
def tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of a program: GROUP_M row tiles of one column tile run side by side, so the
    weight tile they share is read from memory once and from L2 by the others."""
    num_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % rows, (tile % per_group) // rows


@triton.jit
def store_tile(acc, b_ptr, r_ptr, out_ptr, out_off, offs_n, N, out_mask,
                HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """A tile (+ bias, + residual, laid out as the output) in the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + out_off, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def finish_tile(acc, tile, pid_k, part_ptr, counter_ptr, stride_split, b_ptr, r_ptr, out_ptr, out_off, offs_n, N,
                out_mask, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr):
    """store_tile, or with K split over the grid's second axis, this split's partial sums stored and the split
    that finishes last adding them all in split order (triton_arrive.py) before its store_tile."""
    if SPLIT:
        tl.store(part_ptr + pid_k * stride_split + out_off, acc, mask=out_mask)
        if arrive_last(counter_ptr + tile, tl.num_programs(1)):
            acc = tl.zeros_like(acc)
            for s in range(tl.num_programs(1)):
                acc += tl.load(part_ptr + s * stride_split + out_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            store_tile(acc, b_ptr, r_ptr, out_ptr, out_off, offs_n, N, out_mask, HAS_BIAS, HAS_RESIDUAL)
    else:
        store_tile(acc, b_ptr, r_ptr, out_ptr, out_off, offs_n, N, out_mask, HAS_BIAS, HAS_RESIDUAL)
