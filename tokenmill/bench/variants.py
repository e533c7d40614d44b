"""`tokenmill bench variants`: kernel-module variants against the tree in one engine, interleaved.

Fresh GPU machines differ by a few percent, and device time is short, so a kernel change is best measured against
its baseline in the same process: one engine is built, and each variant swaps module files in place (a copy of
a kernel module with the change, or the module as it was at a git revision), the decode graphs are re-captured,
and every variant runs in each round. A variant also generates one greedy answer with the prefix cache off (a
repeated prompt served from the cache would run its last token through other kernels), so a change meant to keep
the bits can be checked against the tree's tokens.

A swap rebinds every reference to the module and, by name, to its top-level functions, classes and objects held
by tokenmill's modules and by the layers' kernel sets (`get_ops`); objects built from the tree's module before the
swap (a layer's weights, say) stay, and so do numbers and strings imported by name.

    tokenmill bench variants --load-format dummy --model-preset llama-3-8b --quantization int4 --async-scheduling \\
        --variant base:tokenmill.kernels.triton_int4_mma:git:HEAD~1 \\
        --variant early:tokenmill.kernels.triton_gemv:work/triton_gemv_early.py
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Iterator

from torch import nn

from tokenmill.bench.common import (Column, add_common_args, build_engine, clock, generate, median, print_table,
                                    result_header, save_json)
from tokenmill.bench.latency import decode_speed
from tokenmill.bench.workloads import random_prompt
from tokenmill.engine.arg_utils import check_at_least, engine_args_from
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

TREE = "tree"
SHARED_VALUES = (type(None), bool, int, float, str, bytes)  # interned objects: their identity says nothing
COLUMNS: list[Column] = [("variant", "variant"), ("tokens_per_s", "tok/s"), ("vs_tree", "vs tree"),
                         ("same_tokens", "same tokens as tree")]


def parse_variant(spec: str) -> tuple[str, str, str]:
    """'NAME:MODULE:PATH' or 'NAME:MODULE:git:REV' -> (name, module, source), source a path or 'git:REV'."""
    parts = spec.split(":", 2)
    if len(parts) != 3 or not all(parts) or parts[0] == TREE or not parts[1].startswith("tokenmill."):
        raise ValueError(f"--variant {spec!r}: expected NAME:MODULE:PATH or NAME:MODULE:git:REV, MODULE a "
                         f"tokenmill module and NAME not {TREE!r}")
    return parts[0], parts[1], parts[2]


def load_variant_module(module: str, source: str, workdir: Path) -> ModuleType:
    """A fresh module object from a file, or from the module's file at a git revision ('git:REV')."""
    if source.startswith("git:"):
        rel = module.replace(".", "/") + ".py"
        text = subprocess.run(["git", "show", f"{source[4:]}:{rel}"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[2])
        if text.returncode:
            raise ValueError(f"git show {source[4:]}:{rel} failed: {text.stderr.strip()}")
        path = workdir / f"{module.replace('.', '_')}_{len(list(workdir.iterdir()))}.py"
        path.write_text(text.stdout)
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"variant file {source} does not exist")
    name = f"_variant_{len(sys.modules)}_{module.rsplit('.', 1)[-1]}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses and Triton look their module up by name
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def swapped(replacements: dict[str, ModuleType], model: nn.Module) -> Iterator[None]:
    """Every reference to a replaced module, or by the same name to one of its top-level objects that the
    replacement also defines, rebound to the replacement's until the block exits: in tokenmill's modules and the
    layers' `ops`. Numbers, strings and None are shared objects, never rebound: a constant imported by name keeps
    the tree's value, so a variant changes the code that uses it."""
    modules: dict[int, ModuleType] = {}
    objects: dict[tuple[str, int], Any] = {}  # (name, id of the tree's object) -> the replacement's
    for name, new in replacements.items():
        old = sys.modules[name]
        modules[id(old)] = new
        for attr, value in vars(old).items():
            if not attr.startswith("__") and hasattr(new, attr) and not isinstance(value, SHARED_VALUES):
                objects[attr, id(value)] = getattr(new, attr)
    holders = [m for n, m in list(sys.modules.items()) if n.startswith("tokenmill") and n not in replacements]
    holders += [m.ops for m in model.modules() if isinstance(getattr(m, "ops", None), SimpleNamespace)]
    undo = []
    for holder in holders:
        for attr, value in list(vars(holder).items()):
            new_value = modules.get(id(value), objects.get((attr, id(value))))
            if new_value is not None and not attr.startswith("__"):
                undo.append((holder, attr, value))
                setattr(holder, attr, new_value)
    try:
        yield
    finally:
        for holder, attr, value in reversed(undo):
            setattr(holder, attr, value)


def batch_speed(engine: LLMEngine, batch_size: int, input_len: int, output_len: int, seed: int) -> float:
    """Tokens/s of batch_size requests of input_len + output_len tokens run together, prefill included."""
    vocab = engine.model_config.vocab_size
    prompts = [random_prompt(input_len, vocab, seed * 1000 + i) for i in range(batch_size)]
    start = clock(engine.device)
    generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    return batch_size * output_len / (clock(engine.device) - start)


def run(ns: argparse.Namespace) -> dict[str, Any]:
    check_at_least(ns, {"input_len": 1, "output_len": 2, "num_iters": 1, "rounds": 1, "batch_size": 1,
                        "check_tokens": 0})
    specs = [parse_variant(s) for s in ns.variant]
    args = dataclasses.replace(engine_args_from(ns), enable_prefix_caching=False)
    with tempfile.TemporaryDirectory() as tmp:
        variants: dict[str, dict[str, ModuleType]] = {TREE: {}}
        for name, module, source in specs:
            importlib.import_module(module)
            variants.setdefault(name, {})[module] = load_variant_module(module, source, Path(tmp))
        engine = build_engine(args)
        runner, model = engine.runner, engine.runner.model
        speeds: dict[str, list[float]] = {name: [] for name in variants}
        tokens: dict[str, list[int]] = {}
        seed = 0
        for r in range(ns.rounds):
            for name, replacements in variants.items():
                with swapped(replacements, model):
                    runner.recapture_graphs()
                    decode_speed(engine, ns.input_len, 4, seed)  # untimed: kernels not used before compile here
                    for _ in range(ns.num_iters):
                        seed += 1
                        speeds[name].append(decode_speed(engine, ns.input_len, ns.output_len, seed)
                                            if ns.batch_size == 1 else
                                            batch_speed(engine, ns.batch_size, ns.input_len, ns.output_len, seed))
                    if r == 0 and ns.check_tokens:
                        prompt = random_prompt(32, engine.model_config.vocab_size, -1)
                        out = generate(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=ns.check_tokens,
                                                                        ignore_eos=True))
                        tokens[name] = list(out[0].outputs[0].token_ids)
        runner.recapture_graphs()
    base = median(speeds[TREE])
    rows = [{"variant": name, "tokens_per_s": median(v), "vs_tree": median(v) / base - 1,
             "same_tokens": (tokens[name] == tokens[TREE]) if tokens else None, "tokens_per_s_all": v}
            for name, v in speeds.items()]
    print_table(rows, COLUMNS, title=f"batch {ns.batch_size}, {ns.input_len} prompt + {ns.output_len} new tokens, "
                                     f"medians of {ns.rounds * ns.num_iters} runs (variants interleaved)")
    result = {**result_header("variants", args, engine.device, {
        "variants": ns.variant, "input_len": ns.input_len, "output_len": ns.output_len, "num_iters": ns.num_iters,
        "rounds": ns.rounds, "batch_size": ns.batch_size, "check_tokens": ns.check_tokens}), "results": rows}
    save_json(result, ns.out)
    return result


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("variants", help="kernel-module variants against the tree in one engine, interleaved")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:MODULE:PATH",
                   help="a variant swapping MODULE (tokenmill.kernels.triton_gemv, say) for the file at PATH, or "
                        "for the module at a git revision (PATH git:REV); repeat a NAME to swap several modules")
    p.add_argument("--input-len", type=int, default=16, help="prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=256, help="new tokens (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="1: decode tokens/s of one request; more: tokens/s of that many requests run together")
    p.add_argument("--num-iters", type=int, default=2, help="timed runs a variant a round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all variants (default: %(default)s)")
    p.add_argument("--check-tokens", type=int, default=64,
                   help="greedy tokens each variant generates for the same-tokens check; 0: none")
    add_common_args(p)
    p.set_defaults(func=run)
