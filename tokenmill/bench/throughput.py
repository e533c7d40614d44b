"""`tokenmill bench throughput`: workload 2 of BENCHMARKS.md, nano-vllm's offline bench: all requests added at
once, ignore_eos, a warm-up on 32 of its prompts first; throughput = generated tokens / wall time including prefill."""
from __future__ import annotations

import argparse
from typing import Any

from tokenmill.bench.common import (Column, add_common_args, clock, generate, num_output_tokens, print_table,
                                    result_header, save_json, warm_up)
from tokenmill.bench.sweep import add_sweep_arg, parse_sweep, run_sweep
from tokenmill.bench.workloads import Workload, nano_vllm_workload
from tokenmill.engine.arg_utils import engine_args_from
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

COLUMNS: list[Column] = [
    ("temperature", "temperature"), ("num_requests", "requests"), ("output_tokens", "output tokens"),
    ("elapsed_s", "time s"), ("output_tokens_per_s", "output tok/s"), ("total_tokens_per_s", "total tok/s"),
    ("num_preemptions", "preemptions"),
]


WARM_UP_REQUESTS = 32  # with prompts up to 1024 tokens, enough for a full 8192-token prefill step


def run_workload(engine: LLMEngine, workload: Workload, temperature: float) -> dict[str, Any]:
    """One timed pass over the workload; the prefix cache is emptied first so no pass reuses another's prompts."""
    engine.kv_cache.reset_prefix_cache()
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
    preemptions = engine.scheduler.stats.num_preemptions
    start = clock(engine.device)
    outputs = generate(engine, workload.prompts, params)
    elapsed = clock(engine.device) - start
    out_tokens = num_output_tokens(outputs)
    return {"temperature": temperature, "num_requests": len(workload.prompts),
            "input_tokens": workload.num_input_tokens, "output_tokens": out_tokens, "elapsed_s": elapsed,
            "requests_per_s": len(outputs) / elapsed, "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (workload.num_input_tokens + out_tokens) / elapsed,
            "num_preemptions": engine.scheduler.stats.num_preemptions - preemptions}


def workload_from(ns: argparse.Namespace, vocab_size: int) -> Workload:
    return nano_vllm_workload(ns.num_requests, ns.max_input_len, ns.max_output_len, ns.min_input_len,
                              ns.min_output_len, vocab_size, ns.workload_seed)


def run(ns: argparse.Namespace) -> dict[str, Any]:
    def measure(engine: LLMEngine) -> list[dict[str, Any]]:
        workload = workload_from(ns, engine.model_config.vocab_size)
        warm_up(engine, workload.prompts[:WARM_UP_REQUESTS])
        return [run_workload(engine, workload, t) for t in ns.temperatures]

    rows, header = run_sweep(engine_args_from(ns), ns.sweep, measure,
                             lambda args, engine: result_header("throughput", args, engine.device, {
                                 "num_requests": ns.num_requests, "min_input_len": ns.min_input_len,
                                 "max_input_len": ns.max_input_len, "min_output_len": ns.min_output_len,
                                 "max_output_len": ns.max_output_len, "seed": ns.workload_seed,
                                 "temperatures": ns.temperatures, "sweep": ns.sweep}))
    print_table(rows, [(k, k) for k in parse_sweep(ns.sweep)[0]] + COLUMNS,
                title=f"offline throughput, nano-vllm workload ({ns.num_requests} requests, input "
                      f"U[{min(ns.min_input_len, ns.max_input_len)}, {ns.max_input_len}], output "
                      f"U[{min(ns.min_output_len, ns.max_output_len)}, {ns.max_output_len}], ignore_eos)")
    result = {**header, "results": rows}
    save_json(result, ns.out)
    return result


def add_workload_args(p: argparse.ArgumentParser, num_requests: int) -> None:
    """The nano-vllm workload's knobs; the defaults (with 256 requests) are BENCHMARKS.md's workload 2 exactly."""
    p.add_argument("--num-requests", type=int, default=num_requests, help="requests (default: %(default)s)")
    p.add_argument("--max-input-len", type=int, default=1024, help="longest prompt (default: %(default)s)")
    p.add_argument("--min-input-len", type=int, default=100,
                   help="shortest prompt, capped at --max-input-len (default: %(default)s)")
    p.add_argument("--max-output-len", type=int, default=1024, help="largest max_tokens (default: %(default)s)")
    p.add_argument("--min-output-len", type=int, default=100,
                   help="smallest max_tokens, capped at --max-output-len (default: %(default)s)")
    p.add_argument("--seed", dest="workload_seed", type=int, default=0,
                   help="Python random seed of the workload; the engine's is --engine-seed (default: %(default)s)")


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("throughput", help="offline throughput on nano-vllm's workload (output and total tokens/s)")
    add_workload_args(p, num_requests=256)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 0.0],
                   help="one timed pass per temperature; 0 = greedy (default: 0.6 0.0)")
    add_sweep_arg(p)
    add_common_args(p)
    p.set_defaults(func=run)
