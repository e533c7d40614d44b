"""Kernel selection: Triton on CUDA, the torch twins elsewhere. Chosen once, at load."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenmill.kernels import torch_ref

OP_NAMES = ("write_kv_cache", "paged_attention", "rotary_embedding", "rope_and_cache", "rms_norm", "fused_add_rms_norm", "silu_and_mul")


def get_ops(device: torch.device | str) -> SimpleNamespace:
    """The kernel set for a device: every name in OP_NAMES, same signatures as torch_ref."""
    if torch.device(device).type == "cuda":
        from tokenmill.kernels import triton_ops
        return SimpleNamespace(**{n: getattr(triton_ops, n) for n in OP_NAMES})
    return SimpleNamespace(**{n: getattr(torch_ref, n) for n in OP_NAMES})
