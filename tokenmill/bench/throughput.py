"""`tokenmill bench throughput`: workload 2 of BENCHMARKS.md, nano-vllm's offline bench: all requests added at
once, ignore_eos, a warm-up on 32 of its prompts first; throughput = generated tokens / wall time including prefill.
Each pass also records where its time went: the steps that prefill, and the decode-only steps by batch size
(`--breakdown` prints it), so a gap to a target points at a phase before a profiler is needed, and the Triton
kernel variants first launched during the pass (each compiled, or loaded from Triton's disk cache, on the spot).
`--hf-requests N` adds the baseline in the same process: the first N requests of the workload through transformers'
continuous batching, and through each tokenmill engine too, so the two are compared on the same requests."""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tokenmill.bench.common import (Column, add_common_args, clock, generate, num_output_tokens, print_table,
                                    release_memory, result_header, save_json, warm_up)
from tokenmill.bench.compare_hf import build_hf_model
from tokenmill.bench.hf_offline import run_hf_workload
from tokenmill.bench.sweep import add_sweep_arg, parse_sweep, run_sweep
from tokenmill.bench.workloads import Workload, nano_vllm_workload
from tokenmill.config import EngineArgs, ModelConfig
from tokenmill.engine.arg_utils import check_at_least, engine_args_from
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

COLUMNS: list[Column] = [
    ("system", "system"), ("temperature", "temperature"), ("num_requests", "requests"),
    ("output_tokens", "output tokens"), ("elapsed_s", "time s"), ("output_tokens_per_s", "output tok/s"),
    ("total_tokens_per_s", "total tok/s"), ("num_preemptions", "preemptions"),
]


WARM_UP_REQUESTS = 32  # with prompts up to 1024 tokens, enough for a full 8192-token prefill step
BATCH_EDGES = (8, 32, 64, 128, 192, 256)  # decode-only steps grouped by batch size: 1-8, 9-32, ..., > 256
BREAKDOWN_COLUMNS: list[Column] = [
    ("phase", "phase"), ("steps", "steps"), ("seconds", "s"), ("share", "share"), ("ms_per_step", "ms/step"),
    ("decode_tokens_per_s", "decode tok/s"),
]


def _phase(prefill_tokens: int, decode_reqs: int) -> tuple[int, str]:
    """(order, name) of a step's phase: prefill, decode-only in a batch-size range, or nothing launched (with
    async scheduling the last step of a pass only reads back the one before)."""
    if prefill_tokens:
        return 0, "prefill steps"
    if not decode_reqs:
        return len(BATCH_EDGES) + 2, "read back only"
    lo = 1
    for i, hi in enumerate(BATCH_EDGES):
        if decode_reqs <= hi:
            return i + 1, f"decode, batch {lo}-{hi}"
        lo = hi + 1
    return len(BATCH_EDGES) + 1, f"decode, batch > {BATCH_EDGES[-1]}"


def step_breakdown(steps: list[tuple[int, int, float]]) -> list[dict[str, Any]]:
    """steps: (prefill tokens, decode requests, host seconds) per engine step. One row for the steps that
    prefill (with whatever decodes ride along), then one per batch-size range of decode-only steps. A step's
    host time is the step() call's; with async scheduling it includes the wait for the step before, so it is
    the pipeline's period and the rows add up to the pass's time."""
    total = sum(t for _, _, t in steps) or 1.0
    groups: dict[tuple[int, str], list[tuple[int, float]]] = {}
    for prefill, decode, seconds in steps:
        groups.setdefault(_phase(prefill, decode), []).append((decode, seconds))
    rows = []
    for (_, name), g in sorted(groups.items()):
        seconds = sum(t for _, t in g)
        rows.append({"phase": name, "steps": len(g), "seconds": seconds, "share": seconds / total,
                     "ms_per_step": 1000 * seconds / len(g),
                     "decode_tokens_per_s": sum(d for d, _ in g) / seconds if seconds else 0.0})
    return rows


def _specialization(name: str, arg_names: list[str], compile_info: dict[str, Any]) -> str:
    """'kernel(arg=value, arg%16, ...)': the constants (constexprs, integers specialized as 1) and the arguments
    specialized as multiples of 16 (argument types and launch options, which can also differ, are left out)."""
    parts = [f"{arg_names[i]}={value}" for (i, *_), value in compile_info["constants"].items()]
    parts += [f"{arg_names[i]}%16" for (i, *_), attrs in compile_info["configs"][0].items()
              if any(attr == "tt.divisibility" for attr, _ in attrs)]
    return f"{name}({', '.join(parts)})"


@contextmanager
def triton_compiles() -> Iterator[list[str]]:
    """The Triton kernel variants first launched in this process inside the block (name and specialization)."""
    compiled: list[str] = []
    try:
        from triton import knobs
    except ImportError:  # no Triton (CPU-only torch): nothing is compiled
        yield compiled
        return
    previous = knobs.runtime.jit_cache_hook

    def hook(**kwargs: Any) -> bool | None:
        compiled.append(_specialization(kwargs["fn"].name, kwargs["fn"].jit_function.arg_names, kwargs["compile"]))
        return previous(**kwargs) if previous else None

    knobs.runtime.jit_cache_hook = hook
    try:
        yield compiled
    finally:
        knobs.runtime.jit_cache_hook = previous


def run_workload(engine: LLMEngine, workload: Workload, temperature: float) -> dict[str, Any]:
    """One timed pass over the workload; the prefix cache is emptied first so no pass reuses another's prompts."""
    engine.reset_prefix_cache()
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
    preemptions = engine.scheduler.stats.num_preemptions
    steps: list[tuple[int, int, float]] = []

    def record(e: LLMEngine) -> None:
        s = e.last_step
        steps.append((s.num_prefill_tokens, s.num_decode_reqs, s.step_time))

    with triton_compiles() as compiled:
        start = clock(engine.device)
        outputs = generate(engine, workload.prompts, params, on_step=record)
        elapsed = clock(engine.device) - start
    out_tokens = num_output_tokens(outputs)
    return {"system": "tokenmill", "temperature": temperature, "num_requests": len(workload.prompts),
            "input_tokens": workload.num_input_tokens, "output_tokens": out_tokens, "elapsed_s": elapsed,
            "requests_per_s": len(outputs) / elapsed, "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (workload.num_input_tokens + out_tokens) / elapsed,
            "num_preemptions": engine.scheduler.stats.num_preemptions - preemptions,
            "breakdown": step_breakdown(steps), "triton_compiles": compiled}


def check_workload_args(ns: argparse.Namespace, temperatures: list[float], option: str) -> None:
    """Before any engine is built: no requests (nothing timed) or empty prompts are no workload, and a temperature
    SamplingParams refuses would fail only after the engine's build and warm-up."""
    check_at_least(ns, {"num_requests": 1, "max_input_len": 1, "min_input_len": 1, "max_output_len": 1,
                        "min_output_len": 1})
    for t in temperatures:
        try:
            SamplingParams(temperature=t)
        except ValueError as e:
            raise ValueError(f"{option}: {e}") from None


def workload_from(ns: argparse.Namespace, vocab_size: int) -> Workload:
    return nano_vllm_workload(ns.num_requests, ns.max_input_len, ns.max_output_len, ns.min_input_len,
                              ns.min_output_len, vocab_size, ns.workload_seed)


def run(ns: argparse.Namespace) -> dict[str, Any]:
    check_workload_args(ns, ns.temperatures, "--temperatures")
    check_at_least(ns, {"hf_requests": 0})
    if ns.hf_requests > ns.num_requests:
        raise ValueError(f"--hf-requests ({ns.hf_requests}) takes the first requests of the workload: at most "
                         f"--num-requests ({ns.num_requests})")

    first_engine: dict[str, Any] = {}

    def measure(engine: LLMEngine) -> list[dict[str, Any]]:
        first_engine.setdefault("model", (engine.model_config, engine.dtype, engine.device))
        workload = workload_from(ns, engine.model_config.vocab_size)
        warm_up(engine, workload.prompts[:WARM_UP_REQUESTS])
        rows = [run_workload(engine, workload, t) for t in ns.temperatures]
        if ns.hf_requests:
            rows += [run_workload(engine, subset(workload, ns.hf_requests), t) for t in ns.temperatures]
        return rows

    args = engine_args_from(ns)
    rows, header = run_sweep(args, ns.sweep, measure,
                             lambda args, engine: result_header("throughput", args, engine.device, {
                                 "num_requests": ns.num_requests, "min_input_len": ns.min_input_len,
                                 "max_input_len": ns.max_input_len, "min_output_len": ns.min_output_len,
                                 "max_output_len": ns.max_output_len, "seed": ns.workload_seed,
                                 "temperatures": ns.temperatures, "sweep": ns.sweep,
                                 "hf_requests": ns.hf_requests}))
    if ns.hf_requests:
        rows += hf_rows(ns, args, *first_engine["model"])
    print_table(rows, [(k, k) for k in parse_sweep(ns.sweep)[0]] + COLUMNS,
                title=f"offline throughput, nano-vllm workload ({ns.num_requests} requests, input "
                      f"U[{min(ns.min_input_len, ns.max_input_len)}, {ns.max_input_len}], output "
                      f"U[{min(ns.min_output_len, ns.max_output_len)}, {ns.max_output_len}], ignore_eos)")
    if ns.breakdown:
        for row in (r for r in rows if "breakdown" in r):
            print_table(row["breakdown"], BREAKDOWN_COLUMNS,
                        title=f"where the time went, temperature {row['temperature']}"
                              + "".join(f", {k} {row[k]}" for k in parse_sweep(ns.sweep)[0]))
            names = sorted({c.split("(", 1)[0] for c in row["triton_compiles"]})
            print(f"Triton kernel variants first launched during the pass: {len(row['triton_compiles'])}"
                  + (f" ({', '.join(names)})" if names else ""))
    result = {**header, "results": rows}
    save_json(result, ns.out)
    return result


def subset(workload: Workload, n: int) -> Workload:
    return Workload(workload.prompts[:n], workload.max_tokens[:n])


def hf_rows(ns: argparse.Namespace, args: EngineArgs, config: ModelConfig, dtype: torch.dtype,
            device: torch.device) -> list[dict[str, Any]]:
    """transformers on the first --hf-requests requests, in the dtype of tokenmill's first engine (released by
    then: the manager sizes its cache from the free memory), random weights for load_format dummy."""
    release_memory()
    model = build_hf_model(config, args, dtype, device, "sdpa")
    workload = subset(workload_from(ns, config.vocab_size), ns.hf_requests)
    rows = [{**run_hf_workload(model, workload, t, device), "dtype": str(dtype).removeprefix("torch.")}
            for t in ns.temperatures]
    del model
    release_memory()
    return rows


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
    p.add_argument("--breakdown", action="store_true",
                   help="print each pass's time by phase: prefill steps, decode-only steps by batch size")
    p.add_argument("--hf-requests", type=int, default=0,
                   help="also run the first N requests through transformers' continuous batching (generate_batch's "
                        "manager) and through tokenmill, in the same process (default: 0, off)")
    add_sweep_arg(p)
    add_common_args(p)
    p.set_defaults(func=run)
