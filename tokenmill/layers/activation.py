"""SiLU(gate) * up over a merged gate/up projection output."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import get_ops


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ops = get_ops(torch.get_default_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
