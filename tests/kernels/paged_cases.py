"""Random paged-attention cases with their dense float64 answer, shared by the twin and Triton tests.

Each sequence's K/V is drawn dense first, then scattered into the block pool through a shuffled block
table with plain Python indexing, so the oracle never touches the paged layout it is checking.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    q: torch.Tensor                 # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor           # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32, 0-padded
    max_query_len: int
    keys: list[torch.Tensor]        # per sequence, dense [seq_len, num_kv_heads, head_dim] float64
    values: list[torch.Tensor]
    query_lens: list[int]
    scale: float


def make_case(seq_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, device: str | torch.device, seed: int = 0,
              garbage: float = 30.0, table_width: int = 0, head_major: bool = True) -> PagedCase:
    """Unused cache slots hold `garbage` (30 or NaN): reading one by mistake shows up in the result.
    table_width pads the block tables to a fixed width (as a CUDA-graph runner would). head_major: the caches
    stored [block, KV head, token, d] as the engine stores them (kv_cache_zeros), else contiguous."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(max(blocks_per_seq, default=0), 1, table_width)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_dim) if head_major else (num_blocks, block_size,
                                                                                   num_kv_heads, head_dim)
    k_cache = torch.full(shape, garbage)
    v_cache = torch.full(shape, garbage)
    if head_major:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    keys, values = [], []
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids, perm = perm[:nb], perm[nb:]
        tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype).float()
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype).float()
        pos = torch.arange(n)
        block_of_pos = torch.tensor(ids, dtype=torch.int64)[pos // block_size]
        k_cache[block_of_pos, pos % block_size] = k
        v_cache[block_of_pos, pos % block_size] = v
        keys.append(k.double())
        values.append(v.double())
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0] + query_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return PagedCase(q=q.to(device), k_cache=k_cache.to(dtype).to(device), v_cache=v_cache.to(dtype).to(device),
                     query_start_loc=starts.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
                     block_tables=tables.to(device), max_query_len=max(query_lens, default=0),
                     keys=keys, values=values, query_lens=list(query_lens), scale=head_dim ** -0.5)


def as_e4m3(case: PagedCase) -> PagedCase:
    """The case with its caches in e4m3 (kv_cache_dtype="fp8") and its dense answer over what they hold."""
    fp8 = torch.float8_e4m3fn
    case.k_cache, case.v_cache = case.k_cache.to(fp8), case.v_cache.to(fp8)
    case.keys = [k.to(fp8).double() for k in case.keys]
    case.values = [v.to(fp8).double() for v in case.values]
    return case


def reference_attention(case: PagedCase) -> torch.Tensor:
    """Dense causal attention in float64, one sequence at a time, kv heads repeated per query head."""
    q = case.q.double()
    out = torch.zeros_like(q)
    start = 0
    for k, v, q_len in zip(case.keys, case.values, case.query_lens):
        k, v = k.to(q.device), v.to(q.device)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        seq_len = k.shape[0]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = torch.einsum("qhd,khd->hqk", q[start:start + q_len], k) * case.scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, v)
        start += q_len
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error; NaN anywhere in out makes it NaN (and fails any bound)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
