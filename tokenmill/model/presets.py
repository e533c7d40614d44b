"""Architectures by name, for `load_format="dummy"` (random weights) and for the memory planner, so big
models can be sized and benchmarked without their checkpoints."""
from __future__ import annotations

import copy

from tokenmill.config import ModelConfig


def _qwen3(hidden: int, ffn: int, layers: int, heads: int, tied: bool) -> ModelConfig:
    """A dense Qwen3: what the sizes share (vocabulary, 8 KV heads of 128, q/k norm, rope, tokens) is fixed."""
    return ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=tied, qk_norm=True,
        bos_token_id=151643, eos_token_id=[151645, 151643], torch_dtype="bfloat16")


PRESETS: dict[str, ModelConfig] = {
    "llama-3-8b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=[128001, 128009], torch_dtype="bfloat16"),
    "llama-3-70b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=[128001, 128009], torch_dtype="bfloat16"),
    # The dense Qwen3 family, from the config.json of Qwen/Qwen3-<size>: head_dim 128 and 8 KV heads throughout,
    # the LM head tied to the embedding up to 4B.
    "qwen3-0.6b": _qwen3(hidden=1024, ffn=3072, layers=28, heads=16, tied=True),
    "qwen3-1.7b": _qwen3(hidden=2048, ffn=6144, layers=28, heads=16, tied=True),
    "qwen3-4b": _qwen3(hidden=2560, ffn=9728, layers=36, heads=32, tied=True),
    "qwen3-8b": _qwen3(hidden=4096, ffn=12288, layers=36, heads=32, tied=False),
    "qwen3-14b": _qwen3(hidden=5120, ffn=17408, layers=40, heads=40, tied=False),
    # 64 x 128 = 8192 query features from a 5120-wide hidden state (head_dim is not hidden / heads)
    "qwen3-32b": _qwen3(hidden=5120, ffn=25600, layers=64, heads=64, tied=False),
    # Mistral-7B v0.3: no sliding window, 32768-token vocabulary.
    "mistral-7b": ModelConfig(
        architecture="MistralForCausalLM", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=[2], torch_dtype="bfloat16"),
    "smollm2-135m": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=[2], torch_dtype="bfloat16"),
    # For tests: small enough to build and run in milliseconds on a CPU.
    "tiny-llama": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=[2], torch_dtype="float32"),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str) -> ModelConfig:
    """A fresh copy of the named preset (callers may edit it)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(preset_names())}")
    return copy.deepcopy(PRESETS[name])
