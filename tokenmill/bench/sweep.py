"""--sweep: a grid search over engine options. Each combination gets a fresh engine, so none inherits another's
KV pool, prefix cache or CUDA graphs."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import typing
from typing import Any, Callable

from tokenmill.bench.common import build_engine, release_memory
from tokenmill.config import EngineArgs
from tokenmill.units import parse_bytes
from tokenmill.engine.llm_engine import LLMEngine

SWEEP_HELP = ("grid search over engine options, one row per combination: e.g. --sweep block_size=16,32 "
              "max_num_seqs=64,256 max_num_batched_tokens=2048,8192")


def add_sweep_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", nargs="+", action="extend", default=None, metavar="OPTION=V1,V2",
                   help=SWEEP_HELP)  # extend: a repeated --sweep adds its axes (the last one alone counted)


def _parse_value(name: str, text: str) -> Any:
    hint = typing.get_type_hints(EngineArgs)[name]
    base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    if text.lower() == "none" and base is not hint:
        return None
    if base is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"--sweep {name}: {text!r} is not a boolean (true/false)")
        return text.lower() in ("true", "1")
    parse = parse_bytes if name == "kv_cache_memory" else base  # as --kv-cache-memory reads it: 512MiB, 2GB
    try:
        return parse(text)
    except ValueError:
        raise ValueError(f"--sweep {name}: {text!r} is not a valid {base.__name__}") from None


def parse_sweep(specs: list[str] | None) -> list[dict[str, Any]]:
    """['block_size=16,32', 'max_num_seqs=64'] -> [{'block_size': 16, 'max_num_seqs': 64}, {'block_size': 32, ...}];
    no specs -> one empty combination (the engine as configured)."""
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    axes: dict[str, list[Any]] = {}
    for spec in specs or []:
        name, sep, values = spec.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or not values:
            raise ValueError(f"--sweep takes OPTION=V1,V2,...; got {spec!r}")
        if name not in fields:
            raise ValueError(f"--sweep: {name!r} is not an engine option; e.g. block_size, max_num_seqs, "
                             "max_num_batched_tokens")
        if name in axes:
            raise ValueError(f"--sweep names {name} twice; give its values once: {name}=V1,V2,...")
        axes[name] = [_parse_value(name, v.strip()) for v in values.split(",")]
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


def combination_args(base: EngineArgs, combo: dict[str, Any]) -> EngineArgs:
    """The base options with this combination's overrides (validated again by EngineArgs)."""
    return dataclasses.replace(base, **combo)


def run_sweep(base: EngineArgs, specs: list[str] | None, measure: Callable[[LLMEngine], list[dict[str, Any]]],
              header: Callable[[EngineArgs, LLMEngine], dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """measure(engine) on a fresh engine per combination, each row prefixed with its combination; the rows and
    a result header of the base options (not the first combination's: the rows say what each one changed), taken
    from the first engine. Each engine is released before the next is built. Every combination is validated
    before the first runs, so a bad value is not found only after the rows before it."""
    rows: list[dict[str, Any]] = []
    first: dict[str, Any] | None = None
    for combo, args in [(c, combination_args(base, c)) for c in parse_sweep(specs)]:
        engine = build_engine(args)
        first = first or header(base, engine)
        rows += [{**combo, **row} for row in measure(engine)]
        del engine
        release_memory()
    return rows, first or {}
