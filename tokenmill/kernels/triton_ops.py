"""The Triton kernel set picked by get_ops on CUDA: every name in OP_NAMES, torch_ref's signatures."""
from tokenmill.kernels.triton_activation import silu_and_mul
from tokenmill.kernels.triton_attention import paged_attention
from tokenmill.kernels.triton_norm import fused_add_rms_norm, rms_norm
from tokenmill.kernels.triton_rope_cache import rope_and_cache, rotary_embedding, write_kv_cache

__all__ = ["write_kv_cache", "paged_attention", "rotary_embedding", "rope_and_cache", "rms_norm",
           "fused_add_rms_norm", "silu_and_mul"]
