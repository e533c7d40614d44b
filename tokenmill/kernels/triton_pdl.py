"""Programmatic dependent launch (Hopper and later): a kernel launched with it is scheduled while the kernel before it
still runs, instead of after that kernel has drained. At batch 1 a decode step is ~200 kernels (bf16; ~260 INT8,
~230 INT4, whose gate/up stores SiLU·mul), most of them a few microseconds long, so the drain-and-fill at each
boundary is a real share of the step (batch-1 decode, Llama-3-8B shape, H200: 224.6 tokens/s without, 233.2 with).
Prefetching a GEMV's first weights into L2 before its wait was tried and lost (229.9 with 1 KB a row, 204.8 with 4
KB): the prefetch competes with the kernel before it for bandwidth. Loading the first sub-tile into registers before
the wait pays only for INT8's "unit" GEMVs (GemvConfig.early: batch-1 INT8 392.8 tokens/s against 389.8; INT4 424.5
against 427.1, bf16 231.4 against 247.0, INT8 "bits" 384.6). Decode attention at small batches reads everything but
q and the new token before its wait (triton_attention's EARLY).

The contract, for every kernel launched with `launch_pdl=True` (PDL constexpr set):
- before `pdl_wait` it may compute addresses and read only what no kernel of the step writes (weights; the
  step's lengths, positions and block tables, copied before its first kernel; K/V that earlier steps cached); it
  writes nothing (its output buffer may still be read by an earlier kernel);
- `pdl_wait` returns once every earlier kernel has finished and its writes are visible;
- `pdl_release` lets the next kernel be scheduled: small kernels call it first thing, GEMVs after their main
  loop. So a run of small kernels and the GEMV after them are resident together (each waiting for the one
  before), while a GEMV's own programs never compete with waiting ones before its last wave. The one-row INT4
  rings, whose programs are all resident at once, and INT8's "unit" GEMVs release right after their wait
  (MmaGemvConfig.release_early, GemvConfig.release_early).

TOKENMILL_PDL=0 turns it off, so a benchmark can measure what it gains."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL_ENV = "TOKENMILL_PDL"


@functools.lru_cache
def pdl_enabled(device_index: int) -> bool:
    """PDL needs an NVIDIA GPU of compute capability 9.0 or later (griddepcontrol); elsewhere, ROCm included
    (whose MI300 also reports 9.x), the kernels launch as before."""
    if os.environ.get(PDL_ENV, "1") not in ("0", "1"):
        raise ValueError(f"{PDL_ENV}={os.environ[PDL_ENV]!r} is not supported; allowed: 0, 1")
    return (os.environ.get(PDL_ENV, "1") == "1" and torch.version.hip is None
            and torch.cuda.get_device_capability(device_index)[0] >= 9)


def pdl_args(t: torch.Tensor) -> dict[str, bool]:
    """The keyword arguments of a launch on t's device: the kernel's PDL flag, and launch_pdl where PDL is on
    (only the NVIDIA backend of Triton knows that option; ROCm's refuses it)."""
    if t.is_cuda and pdl_enabled(t.device.index or 0):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the kernels before have finished and their writes are visible (no-op without PDL)."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel be scheduled now; it still waits for this one in its own pdl_wait."""
    if PDL:
        gdc_launch_dependents()
