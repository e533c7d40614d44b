"""RMSNorm in Triton: one row per program, one pass; without a weight where it was folded into the projection
that reads the output (RMSNorm.fold_into)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_pdl import pdl_args, pdl_release, pdl_wait


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, eps, n_inner, stride_x0, stride_x1,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr, PDL: tl.constexpr):
    """Row r of the [A, B, N] view sits at (r // B, r % B): q/k slices of a fused qkv need no copy."""
    pdl_release(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0)
    a, b = (row // n_inner).to(tl.int64), (row % n_inner).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    xf = tl.load(x_ptr + a * stride_x0 + b * stride_x1 + offs, mask=mask, other=0.0).to(tl.float32)
    y = xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    if HAS_WEIGHT:
        y *= tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * N + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[A, B, N] view with unit stride on N; copies only when no such view exists."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x if x.dim() == 3 else x.reshape(-1, x.shape[-2], x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """torch_ref.rms_norm, as a new tensor."""
    x3 = _as_3d(x)
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x3.shape[0] * x3.shape[1]
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x3, x3 if weight is None else weight, out, eps, x3.shape[1], x3.stride(0), x3.stride(1),
            N=n, BLOCK=block, HAS_WEIGHT=weight is not None,
            num_warps=min(max(block // 512, 1), 16), **pdl_args(x))
    return out
