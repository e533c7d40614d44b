"""Where an engine rank runs: its device (tensor-parallel ranks take one GPU each, by local rank) and the
compute dtype."""
from __future__ import annotations

import os
import re

import torch

from tokenmill.config import parse_dtype

_DEVICES = re.compile(r"cpu|cuda(?::(\d+))?")


def pick_device(device: str, local_rank: int = 0) -> torch.device:
    """The device named by EngineArgs.device; on CUDA, tensor-parallel rank i of a node takes GPU i. The engine
    runs on the CPU and CUDA GPUs only: another torch device (mps, meta, ...) is refused here, not deep in torch."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    m = _DEVICES.fullmatch(device)
    if m is None:
        raise ValueError(f"device={device!r} is not supported; allowed: auto, cpu, cuda, cuda:N (GPU N)")
    if device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but CUDA is not available; use device='cpu'")
    if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: this machine has {torch.cuda.device_count()} GPU(s), "
                         f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    picked = torch.device(device)
    if picked.type == "cuda" and local_rank:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"tensor-parallel local rank {local_rank} needs GPU {local_rank}, but this node has "
                             f"{torch.cuda.device_count()}")
        picked = torch.device("cuda", local_rank)
    return picked


# vLLM's step budgets when none is given (EngineArgs.get_batch_defaults): GPUs of 70 GiB or more, A100s aside
# (larger budgets measured slower there), take 16384 tokens a step for the offline LLM class and 8192 for the API
# server; smaller GPUs 8192 and 2048 (the engine's own default). Offline runs want large prefill steps; a server
# takes smaller ones, which bound the latency a long prompt adds to the decodes sharing its step.
LARGE_GPU_BYTES = 70 << 30
OFFLINE_BUDGET_LARGE_GPU = 16384
OFFLINE_BUDGET_GPU = 8192
SERVER_BUDGET_LARGE_GPU = 8192


def _large_gpu(device: torch.device) -> bool:
    props = torch.cuda.get_device_properties(device)
    return props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower()


def offline_max_num_batched_tokens(device: torch.device, engine_default: int) -> int:
    """The step token budget of the offline LLM class when none is given: vLLM's on CUDA, the engine's default
    elsewhere (on the CPU a step's time grows with its tokens: nothing is gained by larger steps)."""
    if device.type != "cuda":
        return engine_default
    return OFFLINE_BUDGET_LARGE_GPU if _large_gpu(device) else OFFLINE_BUDGET_GPU


def server_max_num_batched_tokens(device: torch.device, engine_default: int) -> int:
    """The step token budget of `tokenmill serve` when none is given: vLLM's API server's on a large GPU, the
    engine's default (vLLM's on smaller GPUs too) elsewhere."""
    if device.type == "cuda" and _large_gpu(device):
        return SERVER_BUDGET_LARGE_GPU
    return engine_default


def pick_dtype(dtype: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return parse_dtype(dtype)
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype in ("float16", "bfloat16"):
        return parse_dtype(checkpoint_dtype)
    return torch.bfloat16


def share_cpu_threads(ranks_on_node: int) -> None:
    """CPU ranks of one node split its cores rather than fight over them (OMP_NUM_THREADS, when set, rules)."""
    if ranks_on_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_node))
