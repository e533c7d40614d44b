"""Torch reference twins of every kernel: the CPU implementation and the test oracle.

Conventions shared with the Triton kernels (tokenmill/kernels/triton_*.py):
- q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
- k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
- slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; a negative slot is padding (skipped)
- query_start_loc: [num_seqs + 1] int32, cumulative query lengths (tokens of sequence i are
  q[query_start_loc[i]:query_start_loc[i+1]])
- seq_lens: [num_seqs] int32, context length of each sequence *including* this step's tokens;
  query token j of sequence i sits at position seq_lens[i] - query_len_i + j and attends causally
  to every cached key at positions <= its own.
- block_tables: [num_seqs, max_blocks_per_seq] int32, padded with 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys and values into their cache slots."""
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[:num_blocks]].flatten(0, 1)[:seq_len]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_query_len: int) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if max_query_len == 1:
        return _paged_decode(q, k_cache, v_cache, seq_lens, block_tables, scale)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        if e == s:
            continue
        k = _gather_context(k_cache, block_tables[i], seq_len).to(q.dtype).transpose(0, 1)
        v = _gather_context(v_cache, block_tables[i], seq_len).to(q.dtype).transpose(0, 1)
        qi = q[s:e].transpose(0, 1)
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        out[s:e] = o.transpose(0, 1)
    return out


def _paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence: gather all contexts at once, padded and masked."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max())
    nb = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :nb]
    k = k_cache[tables].view(num_seqs, nb * block_size, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    v = v_cache[tables].view(num_seqs, nb * block_size, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    mask = torch.arange(nb * block_size, device=q.device)[None, :] < seq_lens[:, None]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=num_heads != num_kv_heads)
    return o.squeeze(2)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate halves) rotary embedding; cos_sin_cache: [max_pos, rot_dim] = cat(cos, sin)."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rot(q), rot(k)


def rope_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotary on q and k, write rotated k and v into the cache; returns rotated q."""
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = cat(gate, up) along the last dim; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
