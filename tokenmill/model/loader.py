"""From a model argument to a ready model: resolve the path, pick the format, read the config, build the
model on its device in its dtype, and fill the weights (from the checkpoint, or random for "dummy")."""
from __future__ import annotations

import os
import zlib
from typing import Iterator

import torch
from torch import nn

from tokenmill.config import SUPPORTED_ARCHITECTURES, ModelConfig, parse_dtype
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.model.default import default_model_path
from tokenmill.model.gguf_loader import iter_gguf_weights, load_gguf_config
from tokenmill.model.hf_loader import in_file, iter_safetensors_weights, load_hf_config
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.presets import get_preset
from tokenmill.quant.loading import prepare_quantized_load, quantizable_modules, quantize_model, resolve_quantization

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
MODEL_REGISTRY: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}
DUMMY_INIT_RANGE = 0.02  # uniform(-r, r): keeps logits and activations of random models in a sane range
_EXPECTED = "a Hugging Face model folder (config.json + *.safetensors) or a .gguf file"


def resolve_model(model: str | None) -> str:
    """The model path to load: the given one, or the bundled default GGUF when None."""
    return default_model_path() if model is None else os.path.expanduser(model)


def resolve_format(model_path: str, load_format: str) -> str:
    """"auto" becomes "safetensors" for a folder and "gguf" for a file; the path must exist."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported; allowed: {', '.join(LOAD_FORMATS)}")
    if not os.path.exists(model_path):
        raise FileNotFoundError(f"model path {model_path} does not exist; expected {_EXPECTED}")
    if load_format == "auto":
        return "safetensors" if os.path.isdir(model_path) else "gguf"
    if load_format == "safetensors" and not os.path.isdir(model_path):
        raise FileNotFoundError(f"{model_path} is not a folder; load_format='safetensors' expects a Hugging Face "
                                "model folder (config.json + *.safetensors)")
    if load_format == "gguf" and not os.path.isfile(model_path):
        raise FileNotFoundError(f"{model_path} is not a file; load_format='gguf' expects a .gguf file")
    return load_format


def load_model_config(model: str | None, load_format: str = "auto", model_preset: str | None = None) -> ModelConfig:
    """The architecture to build. "dummy" takes it from `model_preset`, else from the model's own config."""
    if load_format == "dummy" and model_preset is not None:
        return get_preset(model_preset)
    if load_format == "dummy" and model is None:
        raise ValueError("load_format='dummy' needs a model preset or a model path (folder with config.json "
                         "or .gguf file) to take the architecture from")
    model_path = resolve_model(model)
    if resolve_format(model_path, "auto" if load_format == "dummy" else load_format) == "gguf":
        return load_gguf_config(model_path)
    return load_hf_config(model_path)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]


def _weights(model_path: str, fmt: str) -> Iterator[tuple[str, torch.Tensor]]:
    return iter_gguf_weights(model_path) if fmt == "gguf" else iter_safetensors_weights(model_path)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Deterministic random weights: norms 1, biases 0, every matrix uniform(-0.02, 0.02). Each matrix is drawn
    whole, as a checkpoint would hold it, from a generator seeded by its name, then loaded like a checkpoint
    tensor: every tensor-parallel rank keeps its own slice of the same model, so TP=2 can be checked against TP=1."""
    for module_name, module in model.named_modules():
        if isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)
            continue
        if getattr(module, "bias", None) is not None:
            module.bias.data.zero_()
        for shard, shape in getattr(module, "checkpoint_shapes", {}).items():
            weight = module.weight
            gen = torch.Generator(weight.device).manual_seed(seed * 1_000_003 + zlib.crc32(f"{module_name}#{shard}".encode()))
            full = torch.empty(shape, dtype=weight.dtype, device=weight.device)
            module.load_shard("weight", full.uniform_(-DUMMY_INIT_RANGE, DUMMY_INIT_RANGE, generator=gen), shard)


def load_model(model_config: ModelConfig, model_path: str | None, load_format: str = "auto",
               dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu",
               seed: int = 0, quantization: str | None = None, fold_norms: bool = False,
               quantize_lm_head: bool = False) -> nn.Module:
    """Build the model directly on `device` in `dtype`, fill its weights, and return it in eval mode.
    Quantized projections (`quantization`, or the checkpoint's own; the LM head too with quantize_lm_head) are
    swapped in before weights load.
    fold_norms (the engine's choice; tools that read or save the checkpoint's own layout leave it off): the
    layers' norm weights go into the projections they feed, where those are float or FP8, and SiLU·mul into
    FP8 down projections (LlamaDecoderLayer.fold_norms)."""
    cls = get_model_class(model_config.architecture)
    if load_format != "dummy":
        model_path = resolve_model(model_path)
        load_format = resolve_format(model_path, load_format)
    quant = resolve_quantization(quantization, model_path, load_format, quantize_lm_head)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(parse_dtype(dtype))
    try:
        with torch.device(device):
            model = cls(model_config)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        if quant is not None:
            quantize_model(model, dict.fromkeys(quantizable_modules(model, quant.lm_head), quant.fmt))
    else:
        weights = prepare_quantized_load(model, quant, model_path, load_format) if quant is not None \
            else _weights(model_path, load_format)
        try:
            model.load_weights(weights)
        except ValueError as e:  # a missing, extra or misshapen tensor: say which checkpoint holds it
            raise in_file(model_path, e) from None
    if fold_norms:
        model.fold_norms()
    return model.eval()
