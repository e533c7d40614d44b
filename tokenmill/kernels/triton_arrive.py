"""The last program to arrive finishes the job: a kernel whose programs each write a partial result (a split of
K, a partition of a context) merges them in whichever program writes its partial last, instead of in a second
kernel. At batch 1 a decode step is a few hundred kernels of a few microseconds each, so every launch saved
is a real share of the step.

Each group of programs that merge together owns one int32 counter. A program stores its partial, then adds 1
to the counter (release: its stores are visible before the count); the program that sees count - 1 reads every
partial (acquire) and resets the counter to 0 for the next launch. The merge reads the partials in a fixed
order, so results never depend on which program came last.

The counters live in one zeroed buffer per device, shared by every kernel that uses them: kernels on a device
must not run concurrently on two streams (tokenmill runs one stream a device). The buffer is allocated before
CUDA-graph capture (the eager warm-up runs the same shapes), and a capture that would need a larger one fails
with a clear error instead of baking a graph-pool allocation into the graph."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_COUNTERS = 1 << 16  # 256 KB: more than any grid of one decode step needs (a batch of 8,192 x 8 KV heads)
_buffers: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # outgrown buffers stay allocated: captured CUDA graphs keep their addresses


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters on device (each left at 0 by the kernel that used it)."""
    buf = _buffers.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a kernel needs {n} arrival counters during CUDA-graph capture, but only "
                               f"{0 if buf is None else buf.numel()} were allocated before it; run the same shape "
                               "eagerly before capturing")
        if buf is not None:
            _retired.append(buf)
        buf = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
        _buffers[device] = buf
    return buf


@triton.jit
def arrive_last(counter_ptr, expected):
    """Count this program in at counter_ptr; True in the one of `expected` programs that arrives last, which may
    then read what all of them stored before arriving."""
    tl.debug_barrier()  # every thread's stores are issued before the one release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == expected - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def merged(part_ptrs, stride_split, mask, splits, UNROLLED: tl.constexpr):
    """The sum of `splits` float32 partials at part_ptrs + s * stride_split, in split order. UNROLLED (splits as a
    constant): every load is in flight at once; a loop waits one L2 round trip a split, which decode's
    microsecond kernels feel (INT4 batch 8: +8% from the tensor-core kernel's unrolled merge, docs/BENCHMARKS.md).
    0: the loop, for grids whose split count varies with M (one compile for all of them)."""
    total = tl.zeros(part_ptrs.shape, tl.float32)
    if UNROLLED:
        for s in tl.static_range(UNROLLED):
            total += tl.load(part_ptrs + s * stride_split, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        for s in range(splits):
            total += tl.load(part_ptrs + s * stride_split, mask=mask, other=0.0, cache_modifier=".cg")
    return total
