"""Quantization at load: decide what a load quantizes, swap the model's projections for QuantLinears before
weights arrive, and feed them float tensors (quantized on arrival) or packed ones (GGUF blocks, our own
quantized checkpoints, never through float).

`quantization` values: None (a checkpoint's own quantization_config, else nothing), "int8" / "int4",
"int8-g32" / "int4-g64" style names and "fp8" (quantize the float weights), "gguf" (a GGUF's Q8_0 / Q4_0 / Q4_1
tensors as they are, the LM head's `output` included; its other tensors in float).

The LM head is quantized with the projections on request only (`quantize_lm_head`, like vLLM, which keeps it in
16-bit unless a checkpoint says otherwise); a checkpoint says so with quantization_config.lm_head, a GGUF file
by the type of its output tensor.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open
from torch import nn

from tokenmill.layers.embedding import ParallelLMHead
from tokenmill.layers.linear import Linear
from tokenmill.model.gguf_loader import dequantize_tensor, gguf_tensor_types, iter_gguf_raw_tensors, iter_gguf_weights
from tokenmill.model.hf_loader import iter_safetensors_weights, read_json, safetensors_files
from tokenmill.model.llama import _STACKED
from tokenmill.quant.formats import QuantFormat, QuantizedWeight, UnknownMethodError
from tokenmill.quant.gguf import gguf_to_quantized, native_format
from tokenmill.quant.linear import QuantLinear, to_quant_linear

logger = logging.getLogger(__name__)

QUANT_METHOD = "tokenmill"           # quantization_config.quant_method of our checkpoints
IN_FEATURES_KEY = "tokenmill.in_features"  # safetensors metadata: JSON {weight name: in_features}
GGUF_NATIVE = "gguf"
FLOAT_GGUF_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
LM_HEAD = "lm_head"


@dataclass
class QuantSpec:
    """What a load quantizes. source: 'float' (quantize float weights), 'checkpoint' (packed tensors of our
    own format), 'gguf' (native GGUF blocks; fmt is then per module, from the tensor types)."""
    source: str
    fmt: QuantFormat | None = None
    skip: frozenset[str] = field(default_factory=frozenset)   # module names kept in 16-bit
    lm_head: bool = False                                      # the LM head quantized too (source 'float' or
                                                               # 'checkpoint'; for 'gguf' its tensor type decides)


def checkpoint_quant_config(model_path: str | None) -> dict | None:
    """quantization_config of a Hugging Face folder's config.json, if it has one."""
    if model_path is None or not os.path.isdir(model_path):
        return None
    return read_json(os.path.join(model_path, "config.json"), "a Hugging Face model config").get("quantization_config")


def parse_quantization(quantization: str) -> QuantFormat:
    """The format of a `quantization` value other than 'gguf'; an unknown name's error lists 'gguf' with the
    formats (which are also `tokenmill quantize`'s, where 'gguf' is no choice)."""
    try:
        return QuantFormat.parse(quantization)
    except UnknownMethodError as e:
        raise ValueError(f"{e}, or {GGUF_NATIVE} (a GGUF file's own quantized tensors)") from None


def resolve_quantization(quantization: str | None, model_path: str | None, load_format: str,
                         quantize_lm_head: bool = False) -> QuantSpec | None:
    """The QuantSpec of a load, validated against what the checkpoint holds. quantize_lm_head applies to weights
    quantized at load; a quantized checkpoint or GGUF file says itself whether its LM head is quantized."""
    qc = checkpoint_quant_config(model_path) if load_format in ("auto", "safetensors") else None
    if quantize_lm_head and (qc is not None or quantization in (None, GGUF_NATIVE)):
        raise ValueError("quantize_lm_head quantizes the LM head with weights quantized at load "
                         "(quantization='int8' / 'int4' / 'fp8'); a quantized checkpoint or GGUF file (quantization='gguf') "
                         "keeps its LM head as stored")
    if qc is not None:
        if qc.get("quant_method") != QUANT_METHOD:
            raise ValueError(f"{model_path}: quantization_config.quant_method {qc.get('quant_method')!r} is not "
                             f"supported; supported: {QUANT_METHOD!r} (written by `tokenmill quantize`)")
        fmt = QuantFormat.parse(qc["method"], qc.get("group_size"))
        # 'gguf' is no QuantFormat (parse would call it unsupported): it mismatches a folder as any other does
        if quantization is not None and (quantization == GGUF_NATIVE or parse_quantization(quantization) != fmt):
            raise ValueError(f"{model_path} is already quantized as {fmt.name}; quantization={quantization!r} "
                             "does not match (leave it unset)")
        return QuantSpec("checkpoint", fmt, frozenset(qc.get("modules_to_not_convert", [])), bool(qc.get(LM_HEAD)))
    if quantization is None:
        return None
    if quantization == GGUF_NATIVE:
        if load_format != "gguf":
            raise ValueError("quantization='gguf' keeps a GGUF file's own quantized tensors; the model is not "
                             "a GGUF file")
        return QuantSpec(GGUF_NATIVE)
    fmt = parse_quantization(quantization)
    if load_format == "gguf":
        _warn_requantizing(model_path, quantization, fmt)
    return QuantSpec("float", fmt, lm_head=quantize_lm_head)


def _warn_requantizing(path: str, quantization: str, fmt: QuantFormat) -> None:
    """Say that a GGUF file's quantized projections are rounded a second time (llama.cpp's quantize refuses this
    without --allow-requantize); quality tools compare against their dequantized values on purpose."""
    stored = sorted({qtype.name for name, qtype in gguf_tensor_types(path).items()
                     if name.endswith(".weight") and qtype not in FLOAT_GGUF_TYPES})
    if stored:
        logger.warning("%s stores its weights as %s; quantization=%r re-quantizes their dequantized values to %s "
                       "(a second rounding); quantization='gguf' keeps them as stored", path, ", ".join(stored),
                       quantization, fmt.name)


def linear_modules(model: nn.Module) -> dict[str, Linear]:
    """Every projection of the model (merged ones included, a quantized LM head too), by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def quantizable_modules(model: nn.Module, lm_head: bool) -> dict[str, Linear | ParallelLMHead]:
    """linear_modules, and the LM head with lm_head."""
    modules: dict[str, Linear | ParallelLMHead] = dict(linear_modules(model))
    if lm_head:
        modules[LM_HEAD] = model.get_submodule(LM_HEAD)
    return modules


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize_model(model: nn.Module, plan: dict[str, QuantFormat], from_weights: bool = True) -> None:
    """Swap the planned projections (the LM head among them if planned) for QuantLinears; from_weights rounds
    their current float weights into them (else they stay empty for load_weights)."""
    for name, module in quantizable_modules(model, LM_HEAD in plan).items():
        if name in plan and not isinstance(module, QuantLinear):
            weight = module.weight.data if from_weights else None
            replace_module(model, name, to_quant_linear(module, plan[name], weight))


def checkpoint_module(tensor_name: str) -> tuple[str, int | None]:
    """(module name, shard) a checkpoint tensor loads into, as LlamaForCausalLM.load_weights maps it."""
    module_name = tensor_name.rpartition(".")[0]
    for ckpt, merged, idx in _STACKED:
        if f".{ckpt}" in module_name:
            return module_name.replace(ckpt, merged), idx
    return module_name, None


def _gguf_plan(model: nn.Module, path: str) -> dict[str, QuantFormat]:
    """Projections (the LM head's own output tensor too) whose every shard is stored in one native type of the
    same format."""
    formats: dict[str, set] = {}
    for name, qtype in gguf_tensor_types(path).items():
        if name.endswith(".weight"):
            formats.setdefault(checkpoint_module(name)[0], set()).add(native_format(qtype))
    return {name: next(iter(f)) for name in quantizable_modules(model, LM_HEAD in formats)
            if len(f := formats.get(name, {None})) == 1 and None not in f}


def _iter_gguf(path: str, plan: dict[str, QuantFormat]) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    for tensor in iter_gguf_raw_tensors(path):
        if tensor.name.endswith(".weight") and checkpoint_module(tensor.name)[0] in plan:
            yield tensor.name, gguf_to_quantized(tensor)
        else:
            yield tensor.name, dequantize_tensor(tensor)


def iter_quantized_checkpoint(model_dir: str, fmt: QuantFormat
                              ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """A quantized checkpoint's tensors, each packed weight (+ its _scale / _min) as one QuantizedWeight."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            names = set(f.keys())
            in_features = json.loads((f.metadata() or {}).get(IN_FEATURES_KEY, "{}"))
            for name in sorted(names):
                if name.endswith(("_scale", "_min")) and name.rsplit("_", 1)[0] in names:
                    continue
                if f"{name}_scale" in names:
                    mins = f.get_tensor(f"{name}_min") if f"{name}_min" in names else None
                    qweight = f.get_tensor(name)
                    yield name, QuantizedWeight(fmt, qweight, f.get_tensor(f"{name}_scale"), mins,
                                                in_features.get(name, qweight.shape[1]))
                else:
                    yield name, f.get_tensor(name)


def prepare_quantized_load(model: nn.Module, spec: QuantSpec, model_path: str, load_format: str
                           ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Swap in the QuantLinears (empty) and return the weights iterator that fills the whole model."""
    if spec.source == GGUF_NATIVE:
        plan = _gguf_plan(model, model_path)
        quantize_model(model, plan, from_weights=False)
        return _iter_gguf(model_path, plan)
    plan = {name: spec.fmt for name in quantizable_modules(model, spec.lm_head) if name not in spec.skip}
    quantize_model(model, plan, from_weights=False)
    if spec.source == "checkpoint":
        return iter_quantized_checkpoint(model_path, spec.fmt)
    return iter_gguf_weights(model_path) if load_format == "gguf" else iter_safetensors_weights(model_path)
