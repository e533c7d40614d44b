"""`tokenmill bench profile`: where a decode step's time goes, so an optimization aims at what is measured.

For each batch size: the host time of every engine phase per step (scheduling, batch building, forward launch,
sampling including the wait for the device, token processing, outputs), the device's kernel time per step (torch
profiler) and the idle gap between the two, the top kernels. With --prefill-tokens, the same kernel list for a
step that prefills that many prompt tokens (requests of --input-len, as the offline workload's first steps do).
Then the cost of a verify step of K+1 query tokens against a one-token step for one request: the bound on what
speculative decoding can gain on this machine.

With programmatic dependent launch a kernel starts before the one ahead of it ends and waits inside, so kernel
durations overlap and their sum exceeds the step. The critical-path table charges each kernel what it adds to the
stream instead: its end minus the end of the kernel before it (the first of a step also carries any idle gap
before it), so the rows add up to the step."""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any, Callable

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill.bench.common import (add_common_args, build_engine, clock, median, print_table, result_header,
                                    save_json)
from tokenmill.bench.workloads import random_prompt
from tokenmill.engine.arg_utils import check_at_least, engine_args_from
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.runner.model_runner import ModelInput
from tokenmill.sampling_params import SamplingParams

PHASES = ("step", "schedule", "prepare_input", "forward", "execute", "launch", "read_back", "process_token",
          "collect_outputs")


def _timed(obj: Any, name: str, totals: dict[str, float]) -> None:
    """Wrap obj.name so its wall time accumulates in totals[name]."""
    fn: Callable[..., Any] = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name.strip("_")] += time.perf_counter() - t0
    setattr(obj, name, wrapper)


def _device_kernel_ms(prof: profile, top: int) -> tuple[float, list[tuple[str, float, int]]]:
    """Total device time of all kernels, and the top kernels (name, ms, calls)."""
    rows = []
    for evt in prof.key_averages():
        ms = getattr(evt, "self_device_time_total", getattr(evt, "self_cuda_time_total", 0)) / 1000
        if ms > 0 and evt.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((evt.key[:60], ms, evt.count))
    rows.sort(key=lambda r: -r[1])
    return sum(r[1] for r in rows), rows[:top]


def critical_path(events: list[tuple[str, int, int]], steps: int, top: int) -> list[dict[str, Any]]:
    """Per kernel name, what it adds to a stream's time: events (name, start ns, end ns) of one stream, `steps`
    steps of it; each event is charged its end minus the latest end before it (0 if it ends earlier), so the
    charges add up to the span from the first end to the last. The `top` names by their total, with calls a step
    and the median charge and duration a call."""
    charged: dict[str, list[float]] = defaultdict(list)
    durations: dict[str, list[float]] = defaultdict(list)
    last_end = None
    for name, start, end in sorted(events, key=lambda e: (e[1], e[2])):
        charged[name].append(0.0 if last_end is None else max(end - last_end, 0) / 1e3)
        durations[name].append((end - start) / 1e3)
        last_end = end if last_end is None else max(last_end, end)
    rows = [{"name": name[:60], "ms_per_step": sum(c) / 1e3 / steps, "calls_per_step": len(c) / steps,
             "us_per_call": float(np.median(c)), "duration_us": float(np.median(durations[name]))}
            for name, c in charged.items()]
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:top]


def _device_events(prof: profile) -> list[tuple[str, int, int]]:
    """(name, start ns, end ns) of every device activity (kernels, copies) the profiler recorded."""
    return [(e.name(), e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
            if e.device_type() == torch.autograd.DeviceType.CUDA]


def profile_decode(engine: LLMEngine, batch_size: int, input_len: int, num_steps: int, top: int) -> dict[str, Any]:
    """Prefill batch_size requests, time num_steps decode steps, then profile num_steps more."""
    vocab = engine.model_config.vocab_size
    for i in range(batch_size):
        engine.add_request(None, random_prompt(input_len, vocab, 10_000 + i),
                           SamplingParams(temperature=0.0, max_tokens=2 * num_steps + 8, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    totals: dict[str, float] = defaultdict(float)
    timed = [(engine, "step"), (engine.scheduler, "schedule"), (engine.runner, "prepare_input"),
             (engine.runner, "forward"), (engine.runner, "execute"), (engine.runner, "launch"),
             (engine.runner, "read_back"), (engine, "_process_token"), (engine, "_collect_outputs")]
    for obj, name in timed:
        _timed(obj, name, totals)
    start = clock(engine.device)
    for _ in range(num_steps):
        engine.step()
    wall = clock(engine.device) - start
    for obj, name in timed:
        delattr(obj, name)
    kernel_ms, kernels, path = 0.0, [], []
    if engine.device.type == "cuda":  # a second pass: the profiler's own overhead stays out of the timings above
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(num_steps):
                engine.step()
            torch.cuda.synchronize()
        kernel_ms, kernels = _device_kernel_ms(prof, top)
        path = critical_path(_device_events(prof), num_steps, top)
    while engine.has_unfinished_requests():
        engine.step()
    per_step = {k: 1000 * totals[k] / num_steps for k in PHASES}
    row = {"batch_size": batch_size, "wall_ms": 1000 * wall / num_steps, **{f"{k}_ms": v for k, v in per_step.items()},
           "kernel_ms": kernel_ms / num_steps}
    row["gap_ms"] = row["wall_ms"] - row["kernel_ms"] if kernels else None
    row["top_kernels"] = [{"name": n, "ms_per_step": ms / num_steps, "calls_per_step": c / num_steps}
                          for n, ms, c in kernels]
    row["critical_path"] = path
    return row


def profile_prefill(engine: LLMEngine, num_tokens: int, input_len: int, iters: int, top: int) -> dict[str, Any]:
    """One step prefilling num_tokens prompt tokens (requests of input_len, the last one shorter), timed over
    iters fresh sets of prompts (none shares a prefix with a cached one), then one more profiled."""
    vocab = engine.model_config.vocab_size
    lens = [input_len] * (num_tokens // input_len) + ([num_tokens % input_len] if num_tokens % input_len else [])

    def one_step(seed: int) -> float:
        for i, n in enumerate(lens):
            engine.add_request(None, random_prompt(n, vocab, seed + i),
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        start = clock(engine.device)
        while engine.has_unfinished_requests():
            engine.step()
        return clock(engine.device) - start

    one_step(20_000)  # first launches of this step's shapes
    wall = median([one_step(30_000 + 1_000 * i) for i in range(iters)])
    kernel_ms, kernels = 0.0, []
    if engine.device.type == "cuda":
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            one_step(90_000)
            torch.cuda.synchronize()
        kernel_ms, kernels = _device_kernel_ms(prof, top)
    return {"num_tokens": num_tokens, "requests": len(lens), "wall_ms": 1000 * wall, "kernel_ms": kernel_ms,
            "top_kernels": [{"name": n, "ms": ms, "calls": c} for n, ms, c in kernels]}


def verify_cost(engine: LLMEngine, context_len: int, query_lens: list[int], iters: int) -> list[dict[str, Any]]:
    """One request with context_len tokens of cache: the forward of q query tokens (logits of all q) against q=1."""
    runner = engine.runner
    bs = runner.block_size
    num_blocks = -(-context_len // bs)
    if num_blocks > runner.num_blocks:
        raise ValueError(f"--verify-context {context_len} needs {num_blocks} KV blocks; the pool has {runner.num_blocks}")
    rows = []
    for q in query_lens:
        pos = np.arange(context_len - q, context_len, dtype=np.int64)
        batch = ModelInput(
            input_ids=np.zeros(q, dtype=np.int64), positions=pos, slot_mapping=pos.copy(),
            query_start_loc=np.array([0, q], dtype=np.int32), seq_lens=np.array([context_len], dtype=np.int32),
            block_tables=np.arange(num_blocks, dtype=np.int32)[None, :], sample_rows=np.arange(q, dtype=np.int64),
            max_query_len=q, max_seq_len=context_len)
        times = []
        for i in range(iters + 3):
            start = clock(engine.device)
            runner.forward_all_ranks(batch)
            if i >= 3:
                times.append(clock(engine.device) - start)
        rows.append({"query_len": q, "ms": 1000 * median(times)})
    for r in rows:
        r["x_one_token"] = r["ms"] / rows[0]["ms"]
    return rows


def check_args(ns: argparse.Namespace) -> None:
    """Before the engine is built: zero steps divide by zero, a verify run longer than its context has
    negative positions, and a batch above max_num_seqs would be timed at max_num_seqs under its own label."""
    check_at_least(ns, {"batch_sizes": 1, "input_len": 1, "num_steps": 1, "top": 0, "verify_context": 1,
                        "verify_query_lens": 1, "prefill_tokens": 0})
    budget = engine_args_from(ns).max_num_batched_tokens
    if ns.prefill_tokens > budget:
        raise ValueError(f"--prefill-tokens must be at most --max-num-batched-tokens ({budget}) "
                         f"to run in one step, got {ns.prefill_tokens}")
    prefill_requests = -(-ns.prefill_tokens // ns.input_len)
    if prefill_requests > ns.max_num_seqs:
        raise ValueError(f"--prefill-tokens {ns.prefill_tokens} in requests of --input-len {ns.input_len} needs "
                         f"{prefill_requests} requests; --max-num-seqs is {ns.max_num_seqs}")
    if max(ns.batch_sizes) > ns.max_num_seqs:
        raise ValueError(f"--batch-sizes must be at most --max-num-seqs ({ns.max_num_seqs}), "
                         f"got {max(ns.batch_sizes)}")
    if ns.verify_query_lens and max(ns.verify_query_lens) > ns.verify_context:
        raise ValueError(f"--verify-query-lens must be at most --verify-context ({ns.verify_context}), "
                         f"got {max(ns.verify_query_lens)}")


def run(ns: argparse.Namespace) -> dict[str, Any]:
    check_args(ns)
    args = engine_args_from(ns)
    engine = build_engine(args)
    header = result_header("profile", args, engine.device, {
        "batch_sizes": ns.batch_sizes, "input_len": ns.input_len, "num_steps": ns.num_steps,
        "verify_context": ns.verify_context, "verify_query_lens": ns.verify_query_lens,
        "prefill_tokens": ns.prefill_tokens})
    engine.reset_prefix_cache()
    rows = [profile_decode(engine, b, ns.input_len, ns.num_steps, ns.top) for b in ns.batch_sizes]
    print_table(rows, [("batch_size", "batch"), ("wall_ms", "wall ms"), ("kernel_ms", "kernels ms"),
                       ("gap_ms", "gap ms")] + [(f"{k}_ms", k) for k in PHASES],
                title="decode step: wall time, device kernel time, host phases (ms per step; execute, or launch + "
                      "read_back with --async-scheduling, includes prepare_input, forward and the sampling wait)")
    for r in rows:
        if r["top_kernels"]:
            print_table(r["top_kernels"], [("name", f"top kernels, batch {r['batch_size']}"),
                                           ("ms_per_step", "ms/step"), ("calls_per_step", "calls/step")])
        if r["critical_path"]:
            print_table(r["critical_path"], [("name", f"critical path, batch {r['batch_size']}"),
                                             ("ms_per_step", "ms/step"), ("calls_per_step", "calls/step"),
                                             ("us_per_call", "us/call"), ("duration_us", "duration us")])
    prefill = profile_prefill(engine, ns.prefill_tokens, ns.input_len, 3, ns.top) if ns.prefill_tokens else None
    if prefill:
        print(f"prefill step, {prefill['num_tokens']} tokens in {prefill['requests']} requests: wall "
              f"{prefill['wall_ms']:.2f} ms, kernels {prefill['kernel_ms']:.2f} ms")
        if prefill["top_kernels"]:
            print_table(prefill["top_kernels"], [("name", "top kernels, prefill step"), ("ms", "ms"),
                                                 ("calls", "calls")])
    verify = verify_cost(engine, ns.verify_context, ns.verify_query_lens, ns.num_steps) if ns.verify_query_lens else []
    if verify:
        print_table(verify, [("query_len", "query tokens"), ("ms", "forward ms"), ("x_one_token", "x one token")],
                    title=f"verify step cost, one request with {ns.verify_context} tokens of context")
    result = {**header, "decode": rows, "prefill": prefill, "verify": verify}
    save_json(result, ns.out)
    return result


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("profile", help="where a decode step's time goes (host phases, kernels, gap) and the "
                                         "cost of a speculative verify step")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64], help="decode batches (default: 1 64)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: %(default)s)")
    p.add_argument("--num-steps", type=int, default=50, help="profiled steps per batch (default: %(default)s)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per batch (default: %(default)s)")
    p.add_argument("--prefill-tokens", type=int, default=0,
                   help="also profile one step prefilling this many prompt tokens in requests of --input-len "
                        "(default: 0, none)")
    p.add_argument("--verify-context", type=int, default=512, help="context of the verify run (default: %(default)s)")
    p.add_argument("--verify-query-lens", type=int, nargs="*", default=[1, 2, 4, 6, 8],
                   help="query tokens per verify forward, the first is the baseline (default: 1 2 4 6 8)")
    add_common_args(p)
    p.set_defaults(func=run)
