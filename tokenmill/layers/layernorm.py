"""RMSNorm, with the residual add fused in when a residual is given."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import get_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = get_ops(torch.get_default_device())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
