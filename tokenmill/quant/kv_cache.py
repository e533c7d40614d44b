"""Quantized KV caches: the cache tensor's dtype and row width for each kv_cache_dtype, and the static
per-tensor scales of an fp8 cache.

"int8": per (token, head) scales computed as keys/values are written, stored in-band (head_dim + 4 bytes a
row; see kernels/quant_ref.py). "fp8": e4m3 values with one power-of-two scale per layer for K and one for
V, measured once on a calibration pass and folded into the weights (K's into k_proj / k_norm and the softmax
scale, V's into v_proj and o_proj), so every kernel reads and writes plain e4m3 with no scale at all. Powers
of two keep the folding exact in every weight format; scales are >= 1 (tensors are only ever scaled down
into range) so folded weights and quantized scales never underflow.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.kernels.quant_ref import FP8_MAX, KV_SCALE_BYTES
from tokenmill.layers.attention import AttentionMetadata, PagedAttention, forward_context
from tokenmill.quant.linear import scale_rows_

KV_CACHE_DTYPES = ("auto", "fp8", "int8")
FP8_HEADROOM = 2.0          # calibrated |max| lands at <= FP8_MAX / 2: room for activations the pass missed
CALIBRATION_TOKENS = 256


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the cache tensors for an EngineArgs.kv_cache_dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; allowed: {', '.join(KV_CACHE_DTYPES)}")
    return {"auto": model_dtype, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_cache_dtype]


def kv_row_width(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements of one (token, head) row of the cache: int8 rows carry their float32 scale."""
    return head_dim + KV_SCALE_BYTES if cache_dtype == torch.int8 else head_dim


def _pow2_scale(amax: float) -> float:
    """Smallest power of two >= 1 that brings amax * headroom within fp8 range."""
    return float(2 ** max(0, math.ceil(math.log2(max(amax * FP8_HEADROOM / FP8_MAX, 1e-30)))))


@torch.inference_mode()
def calibrate_kv_amax(model: nn.Module, device: torch.device, dtype: torch.dtype, vocab_size: int,
                      num_tokens: int = CALIBRATION_TOKENS, seed: int = 0) -> list[tuple[float, float]]:
    """max |K| and |V| of every attention layer over one prefill of pseudo-random tokens, as written to a
    float cache (keys after rotary). Leaves every layer's cache empty."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    for m in layers:
        m.k_cache = torch.zeros(1, num_tokens, m.num_kv_heads, m.head_dim, dtype=dtype, device=device)
        m.v_cache = torch.zeros_like(m.k_cache)
    ids = torch.randint(0, vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed)).to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
        max_query_len=num_tokens, max_seq_len=num_tokens)
    with forward_context(meta):
        model(ids, torch.arange(num_tokens, device=device))
    amax = [(m.k_cache.abs().max().item(), m.v_cache.abs().max().item()) for m in layers]
    for m in layers:
        m.k_cache = m.v_cache = torch.empty(0)
    return amax


@torch.no_grad()
def fold_fp8_kv_scales(model: nn.Module, amax: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Fold per-layer (K, V) power-of-two scales into a Llama-family model; returns the scales."""
    scales = []
    for layer, (k_amax, v_amax) in zip(model.model.layers, amax):
        attn = layer.self_attn
        k_scale, v_scale = _pow2_scale(k_amax), _pow2_scale(v_amax)
        q_end, kv = attn.q_size, attn.kv_size
        if k_scale > 1:
            if attn.k_norm is not None:
                attn.k_norm.weight.data /= k_scale
            else:
                scale_rows_(attn.qkv_proj, q_end, q_end + kv, 1 / k_scale)
                if attn.qkv_proj.bias is not None:
                    attn.qkv_proj.bias.data[q_end:q_end + kv] /= k_scale
            attn.attn.scale *= k_scale
        if v_scale > 1:
            scale_rows_(attn.qkv_proj, q_end + kv, q_end + 2 * kv, 1 / v_scale)
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias.data[q_end + kv:] /= v_scale
            scale_rows_(attn.o_proj, 0, attn.o_proj.out_features, v_scale)
        scales.append((k_scale, v_scale))
    return scales


def prepare_fp8_kv(model: nn.Module, device: torch.device, dtype: torch.dtype,
                   vocab_size: int) -> list[tuple[float, float]]:
    """Calibrate and fold the fp8 KV scales of a freshly loaded model; returns the (K, V) scale per layer."""
    return fold_fp8_kv_scales(model, calibrate_kv_amax(model, device, dtype, vocab_size))
