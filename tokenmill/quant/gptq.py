"""GPTQ (Frantar et al. 2022): quantize a weight one input column at a time, pushing each column's rounding
error onto the columns not yet quantized through the inverse Hessian of the layer's inputs (H = X^T X over
calibration tokens), so the layer's *outputs* stay close rather than its weights.

Columns go in decreasing order of their input energy (act order) with each group's scale and min fixed
beforehand from the original weights ("static groups": our groups stay plain contiguous runs), fitted with
the inputs' energies as weights. The result is an ordinary QuantizedWeight, only with better values in it.
On the default model INT4 g128 goes from KL 0.36 (plain rounding) to 0.07 with 4096 calibration tokens.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.quant.formats import QuantFormat, QuantizedWeight, pack_int4, quantize, round_half_away
from tokenmill.quant.loading import LM_HEAD, quantizable_modules

DAMP = 0.01     # fraction of the mean diagonal added to H: keeps the Cholesky stable
BLOCK = 128     # columns updated lazily together


@torch.inference_mode()
def collect_hessians(model: nn.Module, run: Callable[[list[int]], object], windows: list[list[int]],
                     names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """H = mean of x x^T over every calibration token, for the inputs of each named projection (float32,
    on the projection's device); run(ids) does one forward of the model."""
    modules = {n: m for n, m in quantizable_modules(model, names is not None and LM_HEAD in names).items()
               if names is None or n in names}
    sums: dict[str, torch.Tensor] = {}
    counts = dict.fromkeys(modules, 0)

    def hook(name: str) -> Callable:
        def fn(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            if name in sums:
                sums[name].addmm_(x.T, x)
            else:
                sums[name] = x.T @ x
            counts[name] += x.shape[0]
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        for ids in windows:
            run(ids)
    finally:
        for h in handles:
            h.remove()
    return {n: sums[n] / counts[n] for n in sums}


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, fmt: QuantFormat, damp: float = DAMP,
                  block: int = BLOCK) -> QuantizedWeight:
    """Quantize w [N, K] given the mean input outer product hessian [K, K]."""
    w = w.float().clone()
    n, k = w.shape
    group = fmt.group(k)
    h = hessian.float().clone()
    diag = torch.diag(h)
    dead = diag == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    static = quantize(w, fmt, importance=diag.clamp_min(diag.max() * 1e-6))
    scales = static.scales.float()
    mins = None if static.mins is None else static.mins.float()
    order = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diag(h).mean() * torch.eye(k, device=h.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    gidx = order // group
    s_cols = scales[:, gidx]                       # [N, K] in act order
    m_cols = None if mins is None else mins[:, gidx]
    q = torch.empty(n, k, device=w.device)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1, h1 = w[:, i1:i2].clone(), torch.empty(n, i2 - i1, device=w.device), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col, s = w1[:, i], s_cols[:, i1 + i]
            if m_cols is None:
                qc = round_half_away(col / torch.where(s > 0, s, 1.0)).clamp(-127, 127)
                deq = qc * s
            else:
                m = m_cols[:, i1 + i]
                qc = round_half_away((col - m) / torch.where(s > 0, s, 1.0)).clamp(0, 15)
                deq = qc * s + m
            q[:, i1 + i] = qc
            e = (col - deq) / h1[i, i]
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    q = q[:, torch.argsort(order)]
    if fmt.bits == 8:
        return QuantizedWeight(fmt, q.to(torch.int8), scales.half(), None, k)
    return QuantizedWeight(fmt, pack_int4(q.to(torch.uint8)), scales.half(), mins.half(), k)
