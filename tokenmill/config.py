"""Configuration dataclasses, validated once at engine start."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, with Hugging Face `config.json` names."""

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; expected one of " + ", ".join(SUPPORTED_ARCHITECTURES))
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if d.get("sliding_window") and arch == "MistralForCausalLM" and d.get("use_sliding_window", True) \
                and d["sliding_window"] < d.get("max_position_embeddings", 0):
            raise ValueError("Mistral with sliding-window attention is not supported (sliding_window="
                             f"{d['sliding_window']}); use a checkpoint with sliding_window null")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rope_params = d.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_list,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["architectures"] = [d.pop("architecture")]
        d.pop("qk_norm")
        d["model_type"] = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[self.architecture]
        return d
