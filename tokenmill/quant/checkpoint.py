"""`tokenmill quantize` output: a Hugging Face-style folder that LLM(model=DIR) loads quantized.

config.json is the model's config plus a quantization_config ({"quant_method": "tokenmill", "method",
"group_size", "modules_to_not_convert", "lm_head": whether lm_head.weight is packed too}); model.safetensors
holds Hugging Face names with merged projections split back into q/k/v and gate/up, each quantized weight as
`<name>.weight` (packed) + `<name>.weight_scale` (+ `<name>.weight_min`), unquantized tensors in the chosen 16-bit
dtype; the tokenizer goes alongside (copied from a folder, or exported from a GGUF's vocabulary).
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.layers.linear import MergedLinear
from tokenmill.model.llama import _STACKED
from tokenmill.quant.formats import QuantFormat
from tokenmill.quant.linear import QuantLinear
from tokenmill.quant.loading import IN_FEATURES_KEY, LM_HEAD, QUANT_METHOD
from tokenmill.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def _shard_names(module_name: str, n: int) -> list[str]:
    """Checkpoint module names of a merged projection's shards (qkv_proj -> q_proj, k_proj, v_proj)."""
    merged = module_name.rpartition(".")[2]
    names = {idx: ckpt for ckpt, m, idx in _STACKED if m == merged}
    if len(names) != n:
        raise ValueError(f"cannot split {module_name} into {n} checkpoint projections")
    return [module_name.replace(merged, names[i]) for i in range(n)]


def quantized_state(model: nn.Module, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Checkpoint tensors with Hugging Face names (floats in `dtype`), and in_features of every packed weight.
    A tied LM head shares the embedding's parameter and is written once, as the embedding."""
    tensors: dict[str, torch.Tensor] = {}
    in_features: dict[str, int] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        own = {n: p for n, p in module.named_parameters(recurse=False) if id(p) not in seen}
        seen.update(id(p) for p in own.values())
        quant = isinstance(module, QuantLinear)
        if quant:
            own["weight_scale"] = module.weight_scale
            if module.weight_min is not None:
                own["weight_min"] = module.weight_min
        if not own:
            continue
        parts = (zip(_shard_names(module_name, len(module.output_sizes)), module.offsets, module.output_sizes)
                 if isinstance(module, MergedLinear) else [(module_name, 0, None)])
        for name, start, size in parts:
            for attr, t in own.items():
                rows = t if size is None else t[start:start + size]
                packed = quant and attr != "bias"
                tensors[f"{name}.{attr}"] = (rows if packed else rows.to(dtype)).contiguous().cpu()
            if quant:
                in_features[f"{name}.weight"] = module.in_features
    return tensors, in_features


def save_tokenizer(tokenizer: Tokenizer, source: str, out_dir: str) -> None:
    """Copy a folder's tokenizer files, or write tokenizer.json + tokenizer_config.json for a GGUF's."""
    if os.path.isdir(source):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copy2(os.path.join(source, name), os.path.join(out_dir, name))
        return
    tokenizer.backend.save(os.path.join(out_dir, "tokenizer.json"))
    config = dict(tokenizer.special_tokens)
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": tokenizer.eos_token_ids}, f, indent=2)


def save_quantized(model: nn.Module, config: ModelConfig, fmt: QuantFormat, skip: list[str], tokenizer: Tokenizer,
                   source: str, out_dir: str, dtype: torch.dtype) -> None:
    """Write config.json (+ quantization_config), model.safetensors and the tokenizer into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    tensors, in_features = quantized_state(model, dtype)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt", IN_FEATURES_KEY: json.dumps(in_features)})
    hf = config.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    hf["quantization_config"] = {"quant_method": QUANT_METHOD, "method": "fp8" if fmt.fp8 else f"int{fmt.bits}",
                                 "group_size": fmt.group_size, "modules_to_not_convert": sorted(skip),
                                 LM_HEAD: isinstance(model.get_submodule(LM_HEAD), QuantLinear)}
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)
    save_tokenizer(tokenizer, source, out_dir)
