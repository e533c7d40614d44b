"""The Triton kernel set picked by get_ops on CUDA: every name in OP_NAMES, torch_ref's signatures.
An int8 KV cache (its dtype says so) goes to the kernels of triton_kv_quant, except in decode steps (one launch in
triton_attention for every cache dtype, e4m3 in small batches); every other cache dtype, fp8 included, to the
float ones."""
import torch

from tokenmill.kernels import (
    torch_ref,
    triton_attention,
    triton_kv_quant,
    triton_rope_cache,
)
from tokenmill.kernels.triton_activation import silu_and_mul
from tokenmill.kernels.triton_argmax import argmax, race_argmax
from tokenmill.kernels.triton_gemv import dense_gemv
from tokenmill.kernels.triton_norm import rms_norm
from tokenmill.kernels.triton_pending import fill_pending
from tokenmill.kernels.triton_rope_cache import rotary_embedding

__all__ = [
    "argmax",
    "decode_attention",
    "fill_pending",
    "linear",
    "paged_attention",
    "race_argmax",
    "rms_norm",
    "rope_and_cache",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv_cache",
]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, rms_eps: float | None = None,
           residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch_ref.linear. One row in 16 bits (batch-1 decode): the Triton GEMV, which reads small matrices faster
    than cuBLAS (docs/BENCHMARKS.md) and normalizes, adds the residual and casts in the same launch; anything
    else: the norm kernel, then cuBLAS, which writes float32 from 16-bit inputs itself (the LM head's logits: no
    rounding to 16 bits, as in the GEMV, and no conversion pass over them, 0.1 ms a step at batch 256)."""
    half = x.dtype in (torch.bfloat16, torch.float16)
    if x.numel() == x.shape[-1] and half:
        return dense_gemv(x, weight, bias, rms_eps=rms_eps, residual=residual, out_dtype=out_dtype)
    if rms_eps is not None:
        x = rms_norm(x, None, rms_eps)
    if out_dtype == torch.float32 and half and bias is None and residual is None:
        y = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        return y.view(*x.shape[:-1], weight.shape[0])
    return torch_ref.linear(x, weight, bias, residual=residual, out_dtype=out_dtype)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    impl = triton_kv_quant.write_kv_cache_int8 if k_cache.dtype == torch.int8 else triton_rope_cache.write_kv_cache
    impl(k, v, k_cache, v_cache, slot_mapping)


def rope_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> torch.Tensor:
    impl = triton_kv_quant.rope_and_cache_int8 if k_cache.dtype == torch.int8 else triton_rope_cache.rope_and_cache
    return impl(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)


def decode_attention(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """One launch where triton_attention.fuses_rope says so (16- and 32-bit float and int8 caches; e4m3 in small
    batches); otherwise the rotary and cache write in their own kernel first."""
    if not triton_attention.fuses_rope(q, k_cache):
        q = rope_and_cache(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
        return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, 1)
    return triton_attention.decode_attention_rope(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                                  seq_lens, block_tables, scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    max_query_len: int) -> torch.Tensor:
    impl = triton_kv_quant.paged_attention_int8 if k_cache.dtype == torch.int8 else triton_attention.paged_attention
    return impl(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len)
