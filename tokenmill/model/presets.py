"""Architectures by name, for `load_format="dummy"` (random weights) and for the memory planner, so big
models can be sized and benchmarked without their checkpoints."""
from __future__ import annotations

import copy

from tokenmill.config import ModelConfig

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
    "qwen3-0.6b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True,
        bos_token_id=151643, eos_token_id=[151645, 151643], torch_dtype="bfloat16"),
    "qwen3-1.7b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True,
        bos_token_id=151643, eos_token_id=[151645, 151643], torch_dtype="bfloat16"),
    "qwen3-4b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True,
        bos_token_id=151643, eos_token_id=[151645, 151643], torch_dtype="bfloat16"),
    "qwen3-8b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True,
        bos_token_id=151643, eos_token_id=[151645, 151643], torch_dtype="bfloat16"),
    "qwen3-14b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=5120, intermediate_size=17408,
        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True,
        bos_token_id=151643, eos_token_id=[151645, 151643], torch_dtype="bfloat16"),
    # 64 x 128 = 8192 query features from a 5120-wide hidden state (head_dim is not hidden / heads)
    "qwen3-32b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
        num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True,
        bos_token_id=151643, eos_token_id=[151645, 151643], torch_dtype="bfloat16"),
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
