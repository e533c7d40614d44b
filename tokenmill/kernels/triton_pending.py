"""Async scheduling's pending tokens into a step's input ids: one launch (inside a decode step's CUDA graph),
where the torch twin's clamp, gather and select take four."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _fill_pending_kernel(ids_ptr, src_ptr, sampled_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(src_ptr + offs, mask=offs < n, other=-1)
    take = src >= 0
    tl.store(ids_ptr + offs, tl.load(sampled_ptr + src, mask=take), mask=take)


def fill_pending(input_ids: torch.Tensor, token_src: torch.Tensor, sampled: torch.Tensor) -> None:
    """torch_ref.fill_pending (contiguous int64 input ids)."""
    n = input_ids.numel()
    if n:
        _fill_pending_kernel[(triton.cdiv(n, BLOCK),)](input_ids, token_src, sampled, n, BLOCK=BLOCK, num_warps=4)
