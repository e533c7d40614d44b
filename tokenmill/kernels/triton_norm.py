"""RMSNorm in Triton, optionally with the residual add fused in: one row per program, one pass."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_pdl import pdl_args, pdl_release, pdl_wait


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps, n_inner,
                     stride_x0, stride_x1, stride_r0, stride_r1,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """Row r of the [A, B, N] view sits at (r // B, r % B): q/k slices of a fused qkv need no copy.
    With a residual, the sum is rounded to the input dtype before normalising, as the twin does."""
    pdl_release(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0)
    a, b = (row // n_inner).to(tl.int64), (row % n_inner).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + a * stride_x0 + b * stride_x1 + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + a * stride_r0 + b * stride_r1 + offs, mask=mask,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row.to(tl.int64) * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * N + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[A, B, N] view with unit stride on N; copies only when no such view exists."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x if x.dim() == 3 else x.reshape(-1, x.shape[-2], x.shape[-1])


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    x3 = _as_3d(x)
    r3 = _as_3d(residual) if residual is not None else x3
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    rows = x3.shape[0] * x3.shape[1]
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x3, r3, weight, out, res_out, eps, x3.shape[1],
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
            N=n, BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(max(block // 512, 1), 16), **pdl_args(x))
    return out, (res_out if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors; inputs are left untouched."""
    out, res = _launch(x, residual, weight, eps)
    return out, res
