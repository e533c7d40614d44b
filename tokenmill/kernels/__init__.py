"""Kernel selection: Triton on CUDA, the torch twins elsewhere. Chosen once, at load.

TOKENMILL_KERNELS=torch forces the torch twins on CUDA too, so a benchmark can measure what the Triton kernels gain."""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from tokenmill.kernels import torch_ref

OP_NAMES = ("write_kv_cache", "paged_attention", "rotary_embedding", "rope_and_cache", "decode_attention",
            "rms_norm", "silu_and_mul", "linear", "argmax", "race_argmax", "fill_pending")
KERNELS_ENV = "TOKENMILL_KERNELS"
KERNEL_BACKENDS = ("auto", "torch")


def get_ops(device: torch.device | str) -> SimpleNamespace:
    """The kernel set for a device: every name in OP_NAMES, same signatures as torch_ref."""
    backend = os.environ.get(KERNELS_ENV, "auto")
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"{KERNELS_ENV}={backend!r} is not supported; allowed: {', '.join(KERNEL_BACKENDS)}")
    if torch.device(device).type == "cuda" and backend == "auto":
        from tokenmill.kernels import triton_ops
        return SimpleNamespace(**{n: getattr(triton_ops, n) for n in OP_NAMES})
    return SimpleNamespace(**{n: getattr(torch_ref, n) for n in OP_NAMES})
