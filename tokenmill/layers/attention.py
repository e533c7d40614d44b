"""Paged attention front-end: writes this step's K/V into the cache, then attends through block tables.

The per-step metadata travels in a forward context (set by the model runner around each forward) so
model code stays free of batching details and CUDA graphs can capture fixed tensors.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from tokenmill.kernels import get_ops


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens] int64; negative = padding
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32
    max_query_len: int
    max_seq_len: int


_forward_context: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    global _forward_context
    prev, _forward_context = _forward_context, meta
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> AttentionMetadata:
    if _forward_context is None:
        raise RuntimeError("attention called outside a forward_context")
    return _forward_context


class PagedAttention(nn.Module):
    """Rotary + cache write + causal attention over the paged cache, for one layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.ops = get_ops(torch.get_default_device())
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        if meta.max_query_len == 1:
            return self.ops.decode_attention(positions, q, k, v, cos_sin_cache, self.k_cache, self.v_cache,
                                             meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                             meta.block_tables, self.scale)
        q = self.ops.rope_and_cache(positions, q, k, v, cos_sin_cache, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.ops.paged_attention(q, self.k_cache, self.v_cache, meta.query_start_loc, meta.seq_lens,
                                        meta.block_tables, self.scale, meta.max_query_len)
