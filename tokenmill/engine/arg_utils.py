"""Engine options on the command line, generated from EngineArgs so the two never drift apart."""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from tokenmill.config import EngineArgs
from tokenmill.units import parse_bytes

_HELP = {
    "model": "HF model folder or .gguf file (default: the bundled SmolLM2-135M-Instruct GGUF)",
    "load_format": "auto | safetensors | gguf | dummy (random weights)",
    "model_preset": "architecture preset for --load-format dummy (llama-3-8b, qwen3-0.6b, ...)",
    "tokenizer": "tokenizer folder or GGUF (default: the model's)",
    "skip_tokenizer_init": "load no tokenizer: prompts and outputs are token ids only",
    "dtype": "compute dtype: auto | float32 | bfloat16 | float16 (auto: float32 on CPU, bf16 on CUDA)",
    "device": "auto | cpu | cuda | cuda:N",
    "seed": "seed of the engine's random generator",
    "max_model_len": "maximum context (prompt + output) per request",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory": "bytes for the KV cache pool (default 512 MiB on CPU; on CUDA what "
                       "gpu_memory_utilization leaves)",
    "kv_cache_tokens": "the KV cache pool as a number of tokens (all requests together), instead of bytes",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use (weights + activations + KV)",
    "num_gpu_blocks_override": "fix the number of KV blocks",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes",
    "max_num_batched_tokens": "token budget of one engine step (default: 2048; `tokenmill serve` on a GPU of 70 GiB "
                              "or more but an A100: 8192, as vLLM's API server)",
    "max_num_seqs": "maximum running requests",
    "scheduling_policy": "fcfs | priority",
    "max_queue_len": "maximum waiting requests; more are refused",
    "long_prefill_token_threshold": "prompts longer than this get at most this many tokens per step (0: off)",
    "max_long_partial_prefills": "long prompts prefilled concurrently",
    "priority_aging_s": "seconds of waiting that raise a request's priority by one level",
    "timeout_s": "default per-request deadline in seconds",
    "generation_config": "sampling defaults for requests that leave them unset: auto (the model's: a folder's "
                         "generation_config.json, a GGUF's general.sampling keys) | vllm (none: temperature 1, "
                         "top_p 1, ...) | a folder holding a generation_config.json",
    "override_generation_config": "a JSON object over those defaults, in generation_config.json's names "
                                  "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), "
                                  "such as '{\"temperature\": 0.5}'",
    "enforce_eager": "disable CUDA graphs",
    "async_scheduling": "overlap each step's host work with the previous step on the GPU (tokens fed from the "
                        "device; off with speculation, and for steps with penalties, bad words or logprobs)",
    "quantization": "weight quantization: int8 | int4 | fp8 (e4m3 weights and per-token activations) | gguf (a GGUF "
                    "file's own quantized tensors)",
    "quantize_lm_head": "with --quantization int8 | int4 | fp8: quantize the LM head too (off, as in vLLM: a quantized "
                        "checkpoint or GGUF file says itself)",
    "kv_cache_dtype": "auto | fp8 | int8",
    "speculative": "speculative decoding: ngram | draft:<model>[@<quantization>] (<model> 'self': the target)",
    "num_speculative_tokens": "most draft tokens per request per step",
    "prompt_lookup_max": "n-gram speculation: longest suffix looked up in the request's own tokens",
    "prompt_lookup_min": "n-gram speculation: shortest suffix looked up",
    "tensor_parallel_size": "GPUs (or CPU processes) to split the model over",
    "nnodes": "machines the tensor-parallel ranks span (torchrun's --nnodes)",
    "node_rank": "this machine's index: 0 runs the engine, 1 .. nnodes-1 run `tokenmill worker`",
    "master_addr": "address of node 0, where rank 0 listens for the other ranks",
    "master_port": "port of rank 0's rendezvous (default on one node: a free port; needed with --nnodes > 1)",
}


DEVICE_DEFAULTS = ("max_num_batched_tokens",)  # flags whose default some commands choose by device


def json_object(value: str) -> dict[str, typing.Any]:
    """A flag whose value is a JSON object."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): give an object such as '{{\"temperature\": 0.5}}'")
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, such as '{{\"temperature\": 0.5}}'; got "
                                         f"{value!r}")
    return parsed


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--engine-seed" if f.name == "seed" else "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        if hint is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=_HELP[f.name])
            continue
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        if base is int and f.name == "kv_cache_memory":
            base = parse_bytes
        if typing.get_origin(base) is dict:
            base = json_object
        if f.name in DEVICE_DEFAULTS:  # unset stays None: the command picks the default for its device
            parser.add_argument(flag, dest=f.name, type=base, default=None, help=_HELP[f.name])
            continue
        parser.add_argument(flag, dest=f.name, type=base, default=f.default, help=f"{_HELP[f.name]} (default: %(default)s)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs of the parsed flags; an unset device-dependent one (still None) takes EngineArgs' default."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in values.items() if not (k in DEVICE_DEFAULTS and v is None)})


def check_at_least(ns: argparse.Namespace, floors: dict[str, float]) -> None:
    """Options (by dest) below their floor are a ValueError naming the flag ('--num-prompts must be at least 1,
    got 0'), raised before a run starts: a bad count otherwise ends in a crash in the report, or in a run that
    measures nothing. Unset options (None) pass; a list option is checked value by value; NaN never passes."""
    for dest, floor in floors.items():
        value = getattr(ns, dest)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not v >= floor:
                raise ValueError(f"--{dest.replace('_', '-')} must be at least {floor:g}, got {v}")
