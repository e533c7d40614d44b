"""SiLU(gate) * up in Triton over a merged gate/up projection output, read once, written once."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_pdl import pdl_args, pdl_release, pdl_wait


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = cat(gate, up) along the last dim; returns silu(gate) * up."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block = min(triton.next_power_of_2(n), 1024)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), n, BLOCK=block,
                                                                    num_warps=4, **pdl_args(x))
    return out
