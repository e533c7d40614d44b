"""A tiny random Hugging Face checkpoint for the quantization tests: Qwen2-style (q/k/v biases), an
intermediate size (96) that is not a multiple of 64 or 128, and the default model's tokenizer."""
from __future__ import annotations

import json
import os

import torch

from tokenmill.config import ModelConfig
from tokenmill.quant.linear import QuantLinear
from tokenmill.runner.model_runner import ModelRunner

TINY = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=49152, hidden_size=64, intermediate_size=96,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=512, attention_bias=True, tie_word_embeddings=True, eos_token_id=[2])


def tiny_config(**changes) -> ModelConfig:
    return ModelConfig(**{**TINY.__dict__, **changes})


def randomize(model: torch.nn.Module, std: float = 0.08) -> None:
    """Every weight and bias random (norms stay 1), reproducibly."""
    for name, p in model.named_parameters():
        if "norm" not in name:
            p.data.normal_(0, std, generator=torch.Generator().manual_seed(len(name)))


def write_tiny_checkpoint(out: str, default_model_path: str, config: ModelConfig = TINY) -> str:
    """config.json + random model.safetensors + the default model's tokenizer, exported, into `out`."""
    from safetensors.torch import save_file

    from tokenmill.model.loader import load_model
    from tokenmill.quant.checkpoint import quantized_state, save_tokenizer
    from tokenmill.tokenizer import load_tokenizer
    model = load_model(config, None, "dummy", torch.float32, "cpu", seed=3)
    randomize(model)
    tensors, _ = quantized_state(model, torch.float32)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**config.to_hf_dict(), "torch_dtype": "float32"}, f)
    save_tokenizer(load_tokenizer(default_model_path), default_model_path, out)
    return out


def quant_bytes(runner: ModelRunner) -> tuple[int, int]:
    """(packed weight bytes, scale and min bytes) of a runner's quantized projections (a collective_rpc fn)."""
    layers = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    meta = [t for m in layers for t in (m.weight_scale, m.weight_min) if t is not None]
    return (sum(m.weight.numel() * m.weight.element_size() for m in layers),
            sum(t.numel() * t.element_size() for t in meta))
