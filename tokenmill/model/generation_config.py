"""The model's own sampling defaults (vLLM's --generation-config, llama.cpp's general.sampling keys): what a
request that leaves temperature, top_p, top_k, min_p, repetition_penalty or max_tokens unset gets, since a model's
authors tune them (an instruct model trained for temperature 0.6 rambles at 1.0)."""
from __future__ import annotations

import math
import os
from typing import Any

from gguf import GGUFReader

from tokenmill.model.gguf_loader import gguf_field
from tokenmill.model.hf_loader import read_json
from tokenmill.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json's names -> SamplingParams' (vLLM takes the same six; do_sample is ignored, as there)
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
SOURCES = ("auto", "vllm")  # the model's own defaults, or none (SamplingParams' own); else a folder's file


def check_generation_config_args(source: str, override: dict[str, Any] | None) -> None:
    """EngineArgs' generation_config and override_generation_config, checked before a model loads."""
    if source not in SOURCES and not os.path.isfile(os.path.join(os.path.expanduser(source), GENERATION_CONFIG_FILE)):
        raise ValueError(f"generation_config must be 'auto' (the model's sampling defaults), 'vllm' (none) or a "
                         f"folder holding {GENERATION_CONFIG_FILE}; got {source!r}")
    if override:
        unknown = sorted(set(override) - set(HF_KEYS))
        if unknown:
            raise ValueError(f"override_generation_config takes {', '.join(HF_KEYS)}; got {', '.join(unknown)}")
        _checked(_renamed(override, HF_KEYS), "override_generation_config")


def default_sampling(source: str, model_path: str | None, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """SamplingParams keyword defaults: source "auto" reads the model (a folder's generation_config.json, a GGUF
    file's general.sampling.* keys), "vllm" none, else a folder's generation_config.json; override (HF names, as
    vLLM's --override-generation-config) goes over them."""
    found: dict[str, Any] = {}
    where = "the model's sampling defaults"
    if source == "auto" and model_path is not None:  # random weights too: the defaults belong to the model's config
        if os.path.isdir(model_path):
            found, where = _from_folder(model_path)
        elif os.path.isfile(model_path):
            reader = GGUFReader(model_path)
            found = {name: gguf_field(reader, key) for key, name in GGUF_KEYS.items()
                     if reader.get_field(key) is not None}
            where = f"{model_path} (general.sampling keys)"
    elif source not in SOURCES:
        found, where = _from_folder(os.path.expanduser(source))
    found = _checked(found, where)
    return found | _checked(_renamed(override or {}, HF_KEYS), "override_generation_config")


def max_tokens_cap(source: str, defaults: dict[str, Any], override: dict[str, Any] | None) -> int | None:
    """vLLM's cap on every request's max_tokens, even one it sets: max_new_tokens that the operator gave, in
    override_generation_config or a folder's file named as the source; a model's own is only a default."""
    if source in SOURCES:
        return (override or {}).get("max_new_tokens")
    return defaults.get("max_tokens")


def _from_folder(folder: str) -> tuple[dict[str, Any], str]:
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}, path
    config = read_json(path, "a Hugging Face generation config")
    return _renamed({k: v for k, v in config.items() if v is not None}, HF_KEYS), path


def _renamed(values: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    return {names[k]: v for k, v in values.items() if k in names}


def _checked(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Values SamplingParams takes (an integer-valued float is taken as that integer where one is wanted), or a
    ValueError naming where they came from."""
    out = {}
    for name, value in values.items():
        if name in ("top_k", "max_tokens") and isinstance(value, float) and math.isfinite(value) \
                and value.is_integer():
            value = int(value)
        out[name] = value
    if "max_tokens" in out and not (isinstance(out["max_tokens"], int) and out["max_tokens"] >= 1):
        raise ValueError(f"{where}: max_new_tokens must be an integer >= 1, got {out['max_tokens']!r}")
    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    return out
