"""`tokenmill bench parts`: what each part of a layer costs a batch-1 decode step on its critical path, by
skipping it in every layer and timing the step again (the decode graphs re-captured each time).

A kernel profile (`bench profile`) adds up kernel times; with programmatic dependent launch the kernels of a step
overlap, so a kernel's time is not what removing it would save. Skipping says that directly: the attention returns
q, the norms return their input, SiLU·mul returns the gate half, a projection returns its residual (o, down) or a
zero buffer (qkv, gate/up). The text generated is then wrong; only the speed is measured. All variants run in one
engine, interleaved over --rounds, so they share the machine's state. A skipped kernel also moves the launch of the
one after it (each is launched when the one before releases it): skipping the norms measured slower than the full
step on an H100, while the norm kernels running with their outputs unused measured as fast as it
(docs/BENCHMARKS.md, 2026-12-07), so a negative saving says where the next kernel's launch timing matters."""
from __future__ import annotations

import argparse
import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from tokenmill.bench.common import (Column, add_common_args, build_engine, median, print_table, result_header,
                                    save_json)
from tokenmill.bench.latency import decode_speed
from tokenmill.engine.arg_utils import check_at_least, engine_args_from

PART_NAMES = ("attention", "norms", "silu_and_mul", "qkv", "o", "gate_up", "down")
DEFAULT_SKIPS = ["none", *PART_NAMES, "attention+norms+silu_and_mul"]
COLUMNS: list[Column] = [
    ("skipped", "skipped"), ("decode_tokens_per_s", "decode tok/s"), ("decode_ms_per_token", "ms/token"),
    ("us_per_layer_saved", "us/layer saved"),
]


class _Zeros:
    """Zero outputs by (rows, width), allocated at first use: the eager warm-up before each graph capture makes
    them, so a captured step reads them without a fill kernel."""

    def __init__(self, like: torch.Tensor) -> None:
        self.like = like
        self.cache: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, rows: int, width: int) -> torch.Tensor:
        if (rows, width) not in self.cache:
            self.cache[rows, width] = self.like.new_zeros(rows, width)
        return self.cache[rows, width]


def _patches(layer: nn.Module, part: str, zeros: _Zeros) -> list[tuple[Any, str, Callable]]:
    """(object, attribute, replacement) that skip one part of one decoder layer."""
    attn, mlp = layer.self_attn, layer.mlp
    if part == "attention":
        return [(attn.attn, "forward", lambda positions, q, k, v, cos_sin: q)]
    if part == "norms":
        return [(norm, "for_projection", lambda h: (h, None))
                for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
    if part == "silu_and_mul":  # where gate/up's kernel stores SiLU·mul (INT4 decode), its plain product runs
        if mlp.act_in_down:
            raise ValueError("SiLU·mul is folded into this model's down projection; there is no kernel to skip")
        gate_up = mlp.gate_up_proj
        return [(gate_up, "silu_and_mul",
                 lambda x, rms_eps=None: gate_up(x, rms_eps=rms_eps)[..., :gate_up.out_features // 2])]
    if part in ("o", "down"):
        proj = attn.o_proj if part == "o" else mlp.down_proj
        return [(proj, "forward", lambda x, residual=None, **kw: residual)]
    proj = attn.qkv_proj if part == "qkv" else mlp.gate_up_proj
    width = proj.out_features
    return [(proj, "forward", lambda x, rms_eps=None: zeros(x.shape[0], width)),
            (proj, "silu_and_mul", lambda x, rms_eps=None: zeros(x.shape[0], width // 2))]


@contextlib.contextmanager
def skip_parts(model: nn.Module, parts: list[str]) -> Iterator[None]:
    """The model with `parts` (PART_NAMES) skipped in every decoder layer until the block exits."""
    unknown = sorted(set(parts) - set(PART_NAMES))
    if unknown:
        raise ValueError(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PART_NAMES)}")
    zeros = _Zeros(model.model.embed_tokens.weight)
    patches = [p for layer in model.model.layers for part in parts for p in _patches(layer, part, zeros)]
    for obj, name, fn in patches:
        obj.__dict__[name] = fn  # an instance attribute shadows the method until deleted
    try:
        yield
    finally:
        for obj, name, _ in patches:
            del obj.__dict__[name]


def parse_skip(spec: str) -> list[str]:
    """'none' -> [], 'attention+norms' -> ['attention', 'norms']."""
    return [] if spec == "none" else spec.split("+")


def run(ns: argparse.Namespace) -> dict[str, Any]:
    check_at_least(ns, {"input_len": 1, "output_len": 2, "num_iters": 1, "rounds": 1})
    for spec in ns.skip:  # checked before the engine is built
        unknown = sorted(set(parse_skip(spec)) - set(PART_NAMES))
        if unknown:
            raise ValueError(f"--skip {spec}: unknown part(s) {', '.join(unknown)}; known: none, "
                             f"{', '.join(PART_NAMES)} (joined by +)")
    args = engine_args_from(ns)
    engine = build_engine(args)
    runner, model = engine.runner, engine.runner.model
    speeds: dict[str, list[float]] = {spec: [] for spec in ns.skip}
    seed = 0
    for _ in range(ns.rounds):
        for spec in ns.skip:
            with skip_parts(model, parse_skip(spec)):
                runner.recapture_graphs()
                decode_speed(engine, ns.input_len, 2, seed)  # untimed: kernels a skipped part leaves compile here
                for _ in range(ns.num_iters):
                    seed += 1
                    speeds[spec].append(decode_speed(engine, ns.input_len, ns.output_len, seed))
    runner.recapture_graphs()
    base = median(speeds[ns.skip[0]])
    layers = len(model.model.layers)
    rows = [{"skipped": spec, "decode_tokens_per_s": median(v), "decode_ms_per_token": 1000 / median(v),
             "us_per_layer_saved": (1 / base - 1 / median(v)) * 1e6 / layers, "decode_tokens_per_s_all": v}
            for spec, v in speeds.items()]
    print_table(rows, COLUMNS, title=f"batch-1 decode ({ns.input_len} prompt + {ns.output_len} new tokens) with "
                                     f"parts skipped in all {layers} layers, medians of {ns.rounds * ns.num_iters} "
                                     f"runs; saved: against {ns.skip[0]}")
    result = {**result_header("parts", args, engine.device, {
        "input_len": ns.input_len, "output_len": ns.output_len, "num_iters": ns.num_iters, "rounds": ns.rounds,
        "skip": ns.skip}), "results": rows}
    save_json(result, ns.out)
    return result


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("parts", help="what each part of a layer costs a batch-1 decode step, by skipping it")
    p.add_argument("--skip", nargs="+", default=DEFAULT_SKIPS, metavar="PARTS",
                   help="variants, each 'none' or parts joined by '+' (the first is the baseline); parts: "
                        f"{', '.join(PART_NAMES)} (default: none, each part alone, attention+norms+silu_and_mul)")
    p.add_argument("--input-len", type=int, default=16, help="prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=256, help="new tokens (default: %(default)s)")
    p.add_argument("--num-iters", type=int, default=2, help="timed runs a variant a round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over all variants (default: %(default)s)")
    add_common_args(p)
    p.set_defaults(func=run)
