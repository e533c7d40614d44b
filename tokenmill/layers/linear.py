"""Linear layers. Merged projections hold several checkpoint matrices concatenated along the output
dimension, so one matrix product replaces two or three."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_shard(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        """Copy a checkpoint tensor ('weight' or 'bias') into this layer (or one shard of it)."""
        param = getattr(self, name)
        if param is None:
            raise ValueError(f"checkpoint has a {name} the layer does not expect")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
        param.data.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (QKV, gate/up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load_shard(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if shard is None:
            return super().load_shard(name, tensor)
        param = getattr(self, name)
        if param is None:
            raise ValueError(f"checkpoint has a {name} the layer does not expect")
        size = self.output_sizes[shard]
        target = param.data.narrow(0, self.offsets[shard], size)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for {name} shard {shard}: checkpoint {tuple(tensor.shape)}, "
                             f"model {tuple(target.shape)}")
        target.copy_(tensor)
