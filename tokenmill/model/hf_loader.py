"""Hugging Face checkpoint folders: config.json (+ generation_config.json) and safetensors weights,
single-file or sharded through model.safetensors.index.json."""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import torch
from safetensors import safe_open

from tokenmill.config import ModelConfig

SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_json(path: str, what: str) -> dict[str, Any]:
    """Parse a JSON object file; the error names the file and what it should have been."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found; expected {what}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); expected {what}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object; expected {what}")
    return data


def generation_eos_ids(model_dir: str) -> list[int]:
    """eos ids from generation_config.json (instruct models often stop on more tokens than config.json lists)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return []
    eos = read_json(path, "a Hugging Face generation config").get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def in_file(path: str, e: ValueError) -> ValueError:
    """e with the file or folder it is about in front, unless its message names it already."""
    return e if path in str(e) else ValueError(f"{path}: {e}")


def load_hf_config(model_dir: str) -> ModelConfig:
    """The folder's ModelConfig; a config.json that lacks or mangles a field is a ValueError naming the file."""
    path = os.path.join(model_dir, "config.json")
    try:
        config = ModelConfig.from_hf_dict(read_json(path, "a Hugging Face model config (config.json)"))
    except ValueError as e:
        raise in_file(path, e) from None
    for eos in generation_eos_ids(model_dir):
        if eos not in config.eos_token_id:
            config.eos_token_id.append(eos)
    return config


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's weight files: the shards named by the index, else every *.safetensors file."""
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        weight_map = read_json(index_path, "a safetensors shard index with a 'weight_map'").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no 'weight_map'; expected tensor name -> shard file")
        files = [os.path.join(model_dir, name) for name in dict.fromkeys(weight_map.values())]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{len(missing)} shard(s) listed in {index_path} are missing, e.g. {missing[0]}")
        return files
    files = sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}; expected model.safetensors or "
                                f"shards with {SAFETENSORS_INDEX} (.bin/.pt checkpoints are not supported)")
    return files


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, CPU tensor) for every tensor of the checkpoint, one file open at a time."""
    for path in safetensors_files(model_dir):
        with open_safetensors(path) as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:  # safetensors' own error (e.g. data past the end) names neither
                    raise ValueError(f"{path}: tensor {name!r} cannot be read ({e}); expected a complete "
                                     "safetensors file") from e
                yield name, tensor


def open_safetensors(path: str) -> Any:
    """safe_open, with a truncated or corrupt file reported as a ValueError naming it (safetensors' own error
    names neither the file nor the format)."""
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:
        raise ValueError(f"{path} is not a valid safetensors file ({e}); expected safetensors weights "
                         "(an 8-byte header size, a JSON header, then the tensor data)") from e
