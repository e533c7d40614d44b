"""Greedy tokens: the argmax of each row of logits in one launch over the whole GPU. torch's argmax reduces a
row in one block: 27 us for Llama-3's 128,256 logits on an H200, against a 4.2 ms decode step at batch 1.
Sampled tokens: the same reduction over logits * inv_temp - log(noise) (torch_ref.race_argmax), read in one
pass, where torch's temperature division, softmax, race division and argmax read and write the batch's logits
about ten times (0.3 ms a step at 256 rows of 128,256 logits).

Each program takes a chunk of a row; the chunk program that finishes last (triton_arrive.py) picks the best
chunk. Ties go to the lowest index, as in torch.argmax, so greedy tokens equal the CPU engine's."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_arrive import arrive_last, counters

CHUNK = 4096


@triton.jit
def _argmax_kernel(x_ptr, noise_ptr, inv_temp_ptr, val_ptr, idx_ptr, out_ptr, counter_ptr, n, stride_x,
                   stride_noise, CHUNK: tl.constexpr, C_PAD: tl.constexpr, RACE: tl.constexpr):
    """One CHUNK of a row: its maximum and first index, then, in the row's last chunk to finish, the best chunk's.
    RACE: of x * inv_temp - log(noise) instead of x."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    n_chunks = tl.num_programs(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
    if RACE:
        e = tl.load(noise_ptr + row.to(tl.int64) * stride_noise + offs, mask=offs < n, other=1.0)
        x = x * tl.load(inv_temp_ptr + row) - tl.log(e)
    x = tl.where(x != x, float("inf"), x)  # noqa: PLR0124 (x != x: NaN) torch.argmax takes NaN for the maximum
    best, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * n_chunks + chunk, best)
    tl.store(idx_ptr + row * n_chunks + chunk, chunk * CHUNK + i)
    if arrive_last(counter_ptr + row, n_chunks):
        offs_c = tl.arange(0, C_PAD)
        vals = tl.load(val_ptr + row * n_chunks + offs_c, mask=offs_c < n_chunks, other=float("-inf"),
                       cache_modifier=".cg")
        _, c = tl.max(vals, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_ptr + row, tl.load(idx_ptr + row * n_chunks + c, cache_modifier=".cg").to(tl.int64))


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [rows, n] (last dim contiguous) -> int64 [rows], the first index of each row's maximum (into out,
    a contiguous int64 [rows], if given)."""
    return _launch(logits, None, None, out)


def race_argmax(logits: torch.Tensor, inv_temps: torch.Tensor, noise: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """torch_ref.race_argmax: the first index of each row's maximum of logits * inv_temps - log(noise); float32
    inv_temps [rows] and noise [rows, n]."""
    assert inv_temps.dtype == noise.dtype == torch.float32 and noise.shape == logits.shape
    return _launch(logits, inv_temps.contiguous(), noise if noise.stride(1) == 1 else noise.contiguous(), out)


def _launch(logits: torch.Tensor, inv_temps: torch.Tensor | None, noise: torch.Tensor | None,
            out: torch.Tensor | None) -> torch.Tensor:
    rows, n = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n_chunks = triton.cdiv(n, CHUNK)
    vals = torch.empty(rows, n_chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, n_chunks, dtype=torch.int32, device=logits.device)
    race = noise is not None
    _argmax_kernel[(rows, n_chunks)](logits, noise if race else logits, inv_temps if race else logits, vals, idx,
                                     out, counters(logits.device, rows), n, logits.stride(0),
                                     noise.stride(0) if race else 0, CHUNK=CHUNK,
                                     C_PAD=triton.next_power_of_2(n_chunks), RACE=race, num_warps=8)
    return out
