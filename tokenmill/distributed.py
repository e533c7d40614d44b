"""Tensor-parallel process group over torch.distributed (NCCL on GPUs, gloo on CPUs).

With no group initialized, tp size is 1 and every collective is the identity, so single-process code
pays nothing."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = float(os.environ.get("TOKENMILL_DIST_TIMEOUT_S", "120"))


def init_tp_group(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device) -> None:
    """Join the group; a rank that dies makes the others fail within COLLECTIVE_TIMEOUT_S, never hang."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice along the last dim (vocab-parallel logits)."""
    n = tp_size()
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: object | None) -> object:
    """Rank 0 sends a picklable object (a step's batch description) to every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard_range(size: int, rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """[start, end) of this rank's even share of `size` (size must divide evenly)."""
    world = tp_size() if world is None else world
    rank = tp_rank() if rank is None else rank
    if size % world:
        raise ValueError(f"dimension {size} does not split evenly over tensor_parallel_size={world}")
    per = size // world
    return rank * per, (rank + 1) * per
