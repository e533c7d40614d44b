"""RMSNorm. Before a projection its weight can be folded into the projection (fold_into): into a float weight's
input columns, or into an FP8 projection's input quantization; the projection then normalizes its input
itself (torch_ref.linear's rms_eps), which a batch-1 GEMV or the FP8 quantization kernel does in the same
launch, so the norm costs no kernel of its own."""
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

    def fold_into(self, projection: nn.Module) -> None:
        """Hand this norm's weight to the projection it feeds (Linear.fold_norm says how it takes it) and drop
        it, where the projection can take it; then the projection normalizes its own input."""
        if self.weight is None:
            raise ValueError("this norm's weight is already folded")
        if projection.fold_norm(self.weight.data):
            self.weight = None
