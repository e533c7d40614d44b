"""RMSNorm. Before a projection its weight can be folded into the projection's weight (fold_into): the
projection then normalizes its input itself (torch_ref.linear's rms_eps), which a batch-1 GEMV does in the
same launch, so the norm costs no kernel of its own."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import get_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = get_ops(torch.get_default_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def for_projection(self, x: torch.Tensor) -> tuple[torch.Tensor, float | None]:
        """What a projection reading this norm's output takes: (x, eps) once folded, else (norm(x), None)."""
        return (x, self.eps) if self.weight is None else (self(x), None)

    @torch.no_grad()
    def fold_into(self, weight: torch.Tensor) -> None:
        """Scale the input columns of the float weight of the projection this norm feeds by the norm's weight
        (each product rounded once: both are in the model's dtype), and drop it: norm(x) W^T = rms(x) (W diag(g))^T."""
        if self.weight is None:
            raise ValueError("this norm's weight is already folded")
        if not weight.is_floating_point():
            raise ValueError(f"a norm folds only into a float weight, not {weight.dtype}")
        weight.mul_(self.weight.to(weight.dtype))
        self.weight = None
