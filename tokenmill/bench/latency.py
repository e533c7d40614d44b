"""`tokenmill bench latency`: workload 1 of BENCHMARKS.md (one request, 16 random prompt tokens, 256 new tokens,
ignore_eos) timed over its decode phase, prefill speed for one prompt length, and the weight bandwidth that decode
speed implies: bytes of weights read per token x tokens/s, the figure to hold against the memory's copy speed."""
from __future__ import annotations

import argparse
from typing import Any

from tokenmill.bench.common import (Column, add_common_args, clock, generate, median, print_table, result_header,
                                    save_json, weight_bytes)
from tokenmill.bench.sweep import add_sweep_arg, parse_sweep, run_sweep
from tokenmill.bench.workloads import random_prompt
from tokenmill.engine.arg_utils import check_at_least, engine_args_from
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

COLUMNS: list[Column] = [
    ("decode_tokens_per_s", "decode tok/s"), ("decode_ms_per_token", "ms/token"),
    ("prefill_len", "prefill len"), ("prefill_tokens_per_s", "prefill tok/s"),
    ("weight_gb_read_per_token", "weights GB/token"), ("bandwidth_gb_per_s", "bandwidth GB/s"),
]


def decode_speed(engine: LLMEngine, input_len: int, output_len: int, seed: int) -> float:
    """Tokens/s from the first sampled token to the last: the decode phase alone."""
    prompt = random_prompt(input_len, engine.model_config.vocab_size, seed)
    engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    first, num_tokens = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_tokens = len(out.outputs[0].token_ids)
            if first is None and num_tokens:
                first = clock(engine.device)
    last = clock(engine.device)
    if num_tokens < 2:
        raise ValueError(f"--output-len {output_len} leaves no decode phase to time; use at least 2")
    return (num_tokens - 1) / (last - first)


def prefill_speed(engine: LLMEngine, prefill_len: int, seed: int) -> float:
    """Prompt tokens/s until the first token is sampled (chunked when longer than max_num_batched_tokens)."""
    prompt = random_prompt(prefill_len, engine.model_config.vocab_size, seed)
    start = clock(engine.device)
    generate(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return prefill_len / (clock(engine.device) - start)


def bench_latency(engine: LLMEngine, ns: argparse.Namespace) -> dict[str, Any]:
    seeds = iter(range(1_000_000))  # a fresh prompt each time, so the prefix cache never serves one
    for _ in range(ns.num_warmup):
        decode_speed(engine, ns.input_len, min(ns.output_len, 8), next(seeds))
        prefill_speed(engine, ns.prefill_len, next(seeds))
    decode = [decode_speed(engine, ns.input_len, ns.output_len, next(seeds)) for _ in range(ns.num_iters)]
    prefill = [prefill_speed(engine, ns.prefill_len, next(seeds)) for _ in range(ns.num_iters)]
    total, read = weight_bytes(engine.runner.model)
    tps = median(decode)
    return {"decode_tokens_per_s": tps, "decode_ms_per_token": 1000 / tps, "decode_tokens_per_s_all": decode,
            "prefill_len": ns.prefill_len, "prefill_tokens_per_s": median(prefill),
            "prefill_tokens_per_s_all": prefill, "weight_bytes": total, "weight_bytes_read_per_token": read,
            "weight_gb_read_per_token": read / 1e9, "bandwidth_gb_per_s": read * tps / 1e9}


def run(ns: argparse.Namespace) -> dict[str, Any]:
    check_at_least(ns, {"input_len": 1, "output_len": 2, "prefill_len": 1, "num_iters": 1, "num_warmup": 0})
    rows, header = run_sweep(engine_args_from(ns), ns.sweep, lambda engine: [bench_latency(engine, ns)],
                             lambda args, engine: result_header("latency", args, engine.device, {
                                 "input_len": ns.input_len, "output_len": ns.output_len,
                                 "prefill_len": ns.prefill_len, "num_iters": ns.num_iters,
                                 "num_warmup": ns.num_warmup, "sweep": ns.sweep}))
    print_table(rows, [(k, k) for k in parse_sweep(ns.sweep)[0]] + COLUMNS,
                title=f"batch-1 decode ({ns.input_len} prompt + {ns.output_len} new tokens), "
                      f"medians of {ns.num_iters} runs")
    result = {**header, "results": rows}
    save_json(result, ns.out)
    return result


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("latency", help="batch-1 decode tokens/s, prefill tokens/s and achieved weight bandwidth")
    p.add_argument("--input-len", type=int, default=16, help="prompt tokens of the decode run (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=256, help="new tokens of the decode run (default: %(default)s)")
    p.add_argument("--prefill-len", type=int, default=512,
                   help="prompt tokens of the prefill run (default: %(default)s)")
    p.add_argument("--num-iters", type=int, default=3, help="timed runs; medians are reported (default: %(default)s)")
    p.add_argument("--num-warmup", type=int, default=1, help="untimed runs first (default: %(default)s)")
    add_sweep_arg(p)
    add_common_args(p)
    p.set_defaults(func=run)
