"""Token embedding and LM head, split over tensor-parallel ranks along the vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import all_gather_last_dim, all_reduce, shard_range
from tokenmill.kernels import get_ops


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a slice of the vocabulary; ids outside it contribute zeros, then ranks sum."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_start, self.vocab_end = shard_range(vocab_size)
        self.sharded = self.vocab_end - self.vocab_start != vocab_size
        self.checkpoint_shapes: dict[int | None, tuple[int, int]] = {None: (vocab_size, hidden_size)}
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden_size), requires_grad=False)

    def load_shard(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        tensor = tensor[self.vocab_start:self.vocab_end]
        if tuple(tensor.shape) != tuple(self.weight.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(self.weight.shape)}")
        self.weight.data.copy_(tensor)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0.0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary slice, gathered across ranks; float32 for the sampler."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.ops = get_ops(torch.get_default_device())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(self.ops.linear(hidden, self.weight, out_dtype=torch.float32))
