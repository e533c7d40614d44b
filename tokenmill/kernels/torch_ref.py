"""Torch reference twins of every kernel: the CPU implementation and the test oracle.

Conventions shared with the Triton kernels (tokenmill/kernels/triton_*.py):
- q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
- k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (quantized fp8/int8 caches: see quant_ref),
  any strides with a unit last one (the engine's are stored head-major: runner/model_runner.kv_cache_zeros)
- slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; a negative slot is padding (skipped)
- query_start_loc: [num_seqs + 1] int32, cumulative query lengths (tokens of sequence i are
  q[query_start_loc[i]:query_start_loc[i+1]])
- seq_lens: [num_seqs] int32, context length of each sequence *including* this step's tokens;
  query token j of sequence i sits at position seq_lens[i] - query_len_i + j and attends causally
  to every cached key at positions <= its own.
- block_tables: [num_seqs, max_blocks_per_seq] int32, padded with 0.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.kernels.quant_ref import from_kv_cache, to_kv_cache


class _StepMemo:
    """What the twins derive from a step's metadata tensors (the decode gather tables and mask, the rotary rows,
    whether any slot is padding), made by the first layer of a forward and reused by the others: on the CPU the
    ops cost more than their arithmetic. Every layer gets the same tensor objects and the runner makes new ones
    (or new views) each step, so object identity is the key; holding the objects keeps their ids from being
    reused by later tensors."""

    def __init__(self) -> None:
        self.key: tuple = ()
        self.value: Any = None

    def get(self, key: tuple, build: Callable[[], Any]) -> Any:
        if len(key) != len(self.key) or any(a is not b for a, b in zip(key, self.key)):
            self.key, self.value = key, build()
        return self.value


_slots, _decode, _rotary, _rows = _StepMemo(), _StepMemo(), _StepMemo(), _StepMemo()


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys and values into their cache slots (quantized for fp8/int8 caches)."""
    def padding_mask() -> torch.Tensor | None:
        valid = slot_mapping >= 0
        return None if bool(valid.all()) else valid

    valid = _slots.get((slot_mapping,), padding_mask)
    if valid is not None:
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size  # the cache may be a strided view
    k_cache.index_put_((blocks, offsets), to_kv_cache(k, k_cache.dtype))
    v_cache.index_put_((blocks, offsets), to_kv_cache(v, v_cache.dtype))


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[n_blocks, block_size, heads, dim] rows of the cache for int64 block ids (index_select with int64 ids is
    much faster on the CPU than advanced indexing with int32), int8 ones dequantized."""
    return from_kv_cache(cache.index_select(0, block_ids))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_query_len: int) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context."""
    if max_query_len == 1:
        return _paged_decode(q, k_cache, v_cache, seq_lens, block_tables, scale)
    if max_query_len <= ROW_WISE_MAX_QUERY:
        row_seq_lens, row_tables = _rows.get((query_start_loc, seq_lens, block_tables),
                                             lambda: _query_rows(query_start_loc, seq_lens, block_tables))
        return _paged_decode(q, k_cache, v_cache, row_seq_lens, row_tables, scale)
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        if e == s:
            continue
        ids = block_tables[i, :(seq_len + block_size - 1) // block_size].long()
        k = _gather_blocks(k_cache, ids).flatten(0, 1)[:seq_len]
        v = _gather_blocks(v_cache, ids).flatten(0, 1)[:seq_len]
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        out[s:e] = _attend(q[s:e].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask.unsqueeze(0), scale)[0]
    return out


KV_PAD = 64   # key counts are padded (masked) to a multiple of this; see _attend


ROW_WISE_MAX_QUERY = 8   # query runs this short (speculative verification) attend row by row, as decode does


def _query_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token as a decode row of its own: its context length (its position + 1) and its sequence's
    block table. A verified draft token then gets exactly the arithmetic it would get when decoded alone."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_of_row = torch.repeat_interleave(torch.arange(len(query_lens), device=query_lens.device), query_lens)
    offset = torch.arange(int(query_start_loc[-1]), device=query_lens.device) - query_start_loc[seq_of_row]
    row_seq_lens = seq_lens[seq_of_row] - query_lens[seq_of_row] + offset + 1
    return row_seq_lens, block_tables[seq_of_row]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """What attention computes in: float64 for float32 queries, float32 for 16-bit ones. A float32 row then gets
    its float64 result rounded once, so the last bits that SDPA's blocking moves (with the batch, the key count,
    a chunk or a prefix-cache hit, the thread count) stay below float32's: float32 greedy output, FP8's too
    (where e4m3 rounds the next layer's input and would turn such bits into other tokens), does not depend on
    them. 16-bit models keep the float32 kernel (the fast path: its float64 one costs 20-45% of a step)."""
    return torch.float64 if dtype == torch.float32 else torch.float32


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Lq, H, D], k/v [B, Lk, Hkv, D], mask [B, Lq, Lk] (True = attend) -> [B, Lq, H, D].

    Through torch's SDPA with grouped heads (K/V never repeated), in _work_dtype: on the CPU its float32 kernel
    is 2-3x faster than explicit matmuls, while its 16-bit one with a mask falls back to a slow path. Its result
    for a row changes in the last bits with the number of keys it is given, but not between key counts that
    are multiples of 64 (masked keys add exactly nothing there), so keys are padded to a multiple of KV_PAD:
    with one thread a row's float32 output then does not depend on its batch-mates' context lengths. (With
    several threads the kernel also splits work by batch size, and the query blocking changes with the number
    of query rows, e.g. after a prefix-cache hit: for 16-bit models bit-for-bit batch invariance is not
    guaranteed there.)"""
    pad = -k.shape[1] % KV_PAD
    work = _work_dtype(q.dtype)
    kf, vf = k.to(work), v.to(work)
    if pad:
        kf, vf, mask = F.pad(kf, (0, 0, 0, 0, 0, pad)), F.pad(vf, (0, 0, 0, 0, 0, pad)), F.pad(mask, (0, pad))
    o = F.scaled_dot_product_attention(q.to(work).transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2),
                                       attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2).to(q.dtype, memory_format=torch.contiguous_format)


def _paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence: gather all contexts at once, padded and masked. The tables are padded with
    block 0 up to KV_PAD keys (see _attend), so the gather makes the padded length without another copy."""
    num_seqs, block_size = q.shape[0], k_cache.shape[1]

    def layout() -> tuple[torch.Tensor, torch.Tensor, int]:
        nb = (int(seq_lens.max()) + block_size - 1) // block_size
        nb += -nb % max(1, KV_PAD // block_size)
        tables = F.pad(block_tables[:, :nb], (0, nb - min(nb, block_tables.shape[1]))).reshape(-1).long()
        mask = torch.arange(nb * block_size, device=q.device) < seq_lens[:, None]
        return tables, mask[:, None, None, :], nb * block_size

    tables, mask, num_keys = _decode.get((seq_lens, block_tables), layout)
    k = _gather_blocks(k_cache, tables).view(num_seqs, num_keys, k_cache.shape[2], -1)
    v = _gather_blocks(v_cache, tables).view(num_seqs, num_keys, v_cache.shape[2], -1)
    work = _work_dtype(q.dtype)
    o = F.scaled_dot_product_attention(q.to(work).unsqueeze(2), k.to(work).transpose(1, 2),
                                       v.to(work).transpose(1, 2), attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[2])
    return o.squeeze(2).to(q.dtype)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate halves) rotary embedding; cos_sin_cache: [max_pos, rot_dim] = cat(cos, sin).
    As x·cat(cos, cos) + swap_halves(x)·cat(-sin, sin), q and k together: on the CPU each op costs more than its
    arithmetic, and this is the same arithmetic as x1·cos - x2·sin, x2·cos + x1·sin in fewer ops."""
    def rows() -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin_cache.index_select(0, positions).to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    cos, sin = _rotary.get((positions, cos_sin_cache, q.dtype), rows)
    qk = torch.cat((q, k), dim=1)
    qk = qk * cos + qk.roll(qk.shape[-1] // 2, dims=-1) * sin
    return qk.split_with_sizes([q.shape[1], k.shape[1]], dim=1)


def rope_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotary on q and k, write rotated k and v into the cache; returns rotated q."""
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q


def decode_attention(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """A decode step's attention, one query per sequence: rope_and_cache, then paged_attention (a GPU runs both
    in one launch)."""
    q = rope_and_cache(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, rms_eps: float | None = None,
           residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ weight.T + bias (+ residual), in out_dtype (default x's). rms_eps: x is first RMS-normalized without a
    weight, the norm's weight having been folded into this one (RMSNorm.fold_into), so a batch-1 GEMV can
    normalize on the fly. The residual add rounds once, as the GEMV's store does (addmm)."""
    if rms_eps is not None:
        x = rms_norm(x, None, rms_eps)
    if residual is None:
        y = F.linear(x, weight, bias)
    else:
        c = residual.reshape(-1, weight.shape[0])
        y = torch.addmm(c if bias is None else c + bias, x.reshape(-1, x.shape[-1]), weight.t())
        y = y.view(*x.shape[:-1], weight.shape[0])
    return y if out_dtype is None else y.to(out_dtype)


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The first index of each row's maximum (int64), written to out if given."""
    return torch.argmax(logits, dim=-1, out=out)


def race_argmax(logits: torch.Tensor, inv_temps: torch.Tensor, noise: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The exponential race in log form: per row the first index of the maximum of logits * inv_temps -
    log(noise). With noise ~ Exp(1) this is the token argmax(softmax(logits * inv_temps) / noise) draws, a sample
    of that softmax, without computing it (the row's normalizer shifts every score alike)."""
    return torch.argmax(logits * inv_temps[:, None] - noise.log(), dim=-1, out=out)


def fill_pending(input_ids: torch.Tensor, token_src: torch.Tensor, sampled: torch.Tensor) -> None:
    """input_ids[i] = sampled[token_src[i]] where token_src[i] >= 0, in place: async scheduling's tokens that the
    previous step sampled on the device and the host has not read yet."""
    input_ids.copy_(torch.where(token_src >= 0, sampled[token_src.clamp(min=0)], input_ids))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) (* weight), computed in float32 whatever x's dtype (torch's fused op does)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = cat(gate, up) along the last dim; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
