"""Tensor-parallel process group over torch.distributed (NCCL on GPUs, gloo on CPUs).

With no group initialized, tp size is 1 and every collective is the identity, so single-process code
pays nothing. Two groups: the default one carries the model's collectives (NCCL on GPUs); a gloo "control"
group carries rank 0's pickled messages (each step's batch, keepalives, shutdown), as vLLM's CPU group does,
so workers can wait for the next step on the host."""
from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

TIMEOUT_ENV = "TOKENMILL_DIST_TIMEOUT_S"
JOIN_TIMEOUT_ENV = "TOKENMILL_DIST_JOIN_TIMEOUT_S"
_JOINED_KEY = "tokenmill/joined"

_control_group: dist.ProcessGroup | None = None
# run before the group is left: ncclCommDestroy blocks forever while a CUDA graph that captured one of its
# collectives is alive (pytorch/pytorch#115388), so graph owners register their release here
_before_destroy: list[Callable[[], None]] = []
# rank 0 sends from the engine thread and the keepalive thread: one control message (and its replies) at a time
control_lock = threading.RLock()


def collective_timeout_s() -> float:
    """Seconds any collective may wait for a peer; read when a group starts."""
    return float(os.environ.get(TIMEOUT_ENV, "120"))


def join_timeout_s() -> float:
    """Seconds the ranks have to find each other (other nodes may be started by hand, later than node 0)."""
    return float(os.environ.get(JOIN_TIMEOUT_ENV, "600"))


def init_tp_group(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device,
                  check: Callable[[], None] = lambda: None) -> None:
    """Join the group. Rank 0 waits for the others, calling check() meanwhile (it raises when a rank it started
    has died), so a dead rank is seen at once rather than at the join timeout; once joined, every collective
    times out rather than hang."""
    global _control_group
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=join_timeout_s()), wait_for_workers=False)
    joined, deadline = store.add(_JOINED_KEY, 1), time.monotonic() + join_timeout_s()
    while rank == 0 and joined < world_size:
        check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{joined} of {world_size} tensor-parallel ranks joined within {JOIN_TIMEOUT_ENV}="
                               f"{join_timeout_s():g}s; start every node's `tokenmill worker` within that time")
        time.sleep(0.05)
        joined = store.add(_JOINED_KEY, 0)
    timeout = datetime.timedelta(seconds=collective_timeout_s())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timeout)
    _control_group = dist.new_group(backend="gloo", timeout=timeout)


def on_destroy(release: Callable[[], None]) -> None:
    """Call release() before this process leaves the group (CUDA graphs holding NCCL collectives)."""
    _before_destroy.append(release)


def destroy_tp_group() -> None:
    """Leave the group (if any): tp size is 1 again, so another engine can start in this process."""
    global _control_group
    while _before_destroy:
        with contextlib.suppress(Exception):  # after a failure the device may refuse; leaving must not
            _before_destroy.pop()()
    if dist.is_initialized():
        dist.destroy_process_group()
    _control_group = None


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's value (KV blocks: each rank may measure a different free memory)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_control_group)
    return int(t.item())


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice along the last dim (vocab-parallel logits)."""
    n = tp_size()
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x, in place on every rank, over the model's group (on the device, in stream order)."""
    dist.broadcast(x, src=0)
    return x


def broadcast_object(obj: object | None) -> object:
    """Rank 0 sends a picklable object (a step's batch description) to every rank over the control group."""
    box = [obj]
    with control_lock:
        dist.broadcast_object_list(box, src=0, group=_control_group)
    return box[0]


def gather_object(obj: object) -> list[object] | None:
    """Every rank's object, in rank order, on rank 0 (None elsewhere)."""
    out = [None] * tp_size() if tp_rank() == 0 else None
    with control_lock:
        dist.gather_object(obj, out, dst=0, group=_control_group)
    return out


def shard_range(size: int, rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """[start, end) of this rank's even share of `size` (size must divide evenly)."""
    world = tp_size() if world is None else world
    rank = tp_rank() if rank is None else rank
    if size % world:
        raise ValueError(f"dimension {size} does not split evenly over tensor_parallel_size={world}")
    per = size // world
    return rank * per, (rank + 1) * per
