"""Rotary position embedding tables (default, linear and Llama-3 frequency scaling)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Holds cos_sin_cache [max_positions, head_dim] = cat(cos, sin) in float32."""

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, base, scaling)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()
        self.register_buffer("cos_sin_cache", cache, persistent=False)
