"""`tokenmill bench ablation`: the "from naive to fast" ladder on one workload (the nano-vllm draw, shrinkable), one
row per step, each adding one idea to the previous:

1. recompute, no KV cache: every step runs the full forward over all tokens so far (a short run: its cost grows
   with the square of the length);
2. KV cache, static batching: requests in fixed batches of max_num_seqs, a batch finishing before the next starts;
3. continuous batching: all requests queued, finished ones replaced at once (the engine as it runs);
4. fused Triton kernels instead of their torch twins (CUDA only);
5. CUDA graphs for decode steps (CUDA only);
6. weight quantization, when --quantization names a scheme.

Steps 1-3 use the torch twins and eager mode on every device so that each later row shows one gain alone."""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.bench.common import (Column, add_common_args, build_engine, clock, generate, num_output_tokens,
                                    print_table, release_memory, result_header, save_json, warm_up)
from tokenmill.bench.throughput import add_workload_args, check_workload_args, workload_from
from tokenmill.bench.workloads import Workload
from tokenmill.config import EngineArgs
from tokenmill.engine.arg_utils import check_at_least, engine_args_from
from tokenmill.engine.llm_engine import LLMEngine, pick_device
from tokenmill.layers.attention import AttentionMetadata, forward_context
from tokenmill.sampling_params import SamplingParams

COLUMNS: list[Column] = [
    ("step", "step"), ("output_tokens_per_s", "output tok/s"), ("gain_vs_previous", "x previous"),
    ("gain_vs_first", "x first"), ("elapsed_s", "time s"), ("output_tokens", "output tokens"), ("note", "note"),
]


@dataclass(frozen=True)
class Step:
    name: str
    mode: str                   # "recompute" | "static" | "continuous"
    kernels: str                # TOKENMILL_KERNELS while the engine is built: "torch" | "auto"
    cuda_graphs: bool
    quantization: str | None = None
    skip: str | None = None     # why this step cannot run here

    def engine_args(self, base: EngineArgs) -> EngineArgs:
        return dataclasses.replace(base, enforce_eager=not self.cuda_graphs, quantization=self.quantization)


def ladder(device: torch.device, quantization: str | None) -> list[Step]:
    cuda = device.type == "cuda"
    return [
        Step("recompute, no KV cache", "recompute", "torch", False),
        Step("KV cache, static batching", "static", "torch", False),
        Step("continuous batching", "continuous", "torch", False),
        Step("fused Triton kernels", "continuous", "auto", False, skip=None if cuda else
             "skipped: the Triton kernels need CUDA; on this device the engine runs the torch twins"),
        Step("CUDA graphs", "continuous", "auto", cuda, skip=None if cuda else "skipped: CUDA graphs need CUDA"),
        Step(f"quantization ({quantization})" if quantization else "quantization", "continuous", "auto", cuda,
             quantization, skip=None if quantization else "skipped: pass --quantization SCHEME to add this step"),
    ]


@torch.inference_mode()
def recompute_generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int],
                       temperature: float) -> list[list[int]]:
    """Generate without reusing any K/V: each step feeds every sequence's whole history through the model. The
    attention layers still write K/V somewhere, so each sequence owns fixed blocks that every step overwrites.
    Returns the new tokens of each prompt."""
    runner, device = engine.runner, engine.device
    model, bs = runner.model, runner.block_size
    needed = [math.ceil((len(p) + m) / bs) for p, m in zip(prompts, max_tokens)]
    if sum(needed) > runner.num_blocks - 1:
        raise ValueError(f"the recompute step needs {sum(needed)} KV blocks but the pool has {runner.num_blocks - 1}; "
                         "lower --naive-requests or --naive-max-tokens")
    host_tables = np.zeros((len(prompts), max(needed)), dtype=np.int64)  # block 0 is the pool's reserved block
    for i, (first, n) in enumerate(zip(np.cumsum([1] + needed[:-1]), needed)):
        host_tables[i, :n] = np.arange(first, first + n)
    tables = torch.from_numpy(host_tables).to(device, torch.int32)
    generator = torch.Generator(device).manual_seed(engine.args.seed)
    seqs = [list(p) for p in prompts]
    active = list(range(len(seqs)))
    while active:
        lens = [len(seqs[i]) for i in active]
        positions = np.concatenate([np.arange(n) for n in lens])
        owner = np.repeat(active, lens)
        slots = host_tables[owner, positions // bs] * bs + positions % bs
        ends = np.cumsum(lens)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(device),
            query_start_loc=torch.tensor([0, *ends], dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_tables=tables[active],
            max_query_len=max(lens), max_seq_len=max(lens))
        ids = torch.tensor([t for i in active for t in seqs[i]], dtype=torch.long, device=device)
        with forward_context(meta):
            hidden = model(ids, torch.from_numpy(positions).to(device))
        logits = model.compute_logits(hidden[torch.from_numpy(ends - 1).to(device)])
        if temperature == 0:
            tokens = logits.argmax(-1)
        else:
            tokens = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        for i, t in zip(active, tokens.tolist()):
            seqs[i].append(t)
        active = [i for i in active if len(seqs[i]) < len(prompts[i]) + max_tokens[i]]
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def run_step(engine: LLMEngine, step: Step, workload: Workload, ns: argparse.Namespace) -> dict[str, Any]:
    engine.reset_prefix_cache()
    batch = engine.args.max_num_seqs
    note = None
    start = clock(engine.device)
    if step.mode == "recompute":
        k = min(ns.naive_requests, batch, len(workload.prompts))
        caps = [min(m, ns.naive_max_tokens) for m in workload.max_tokens[:k]]
        tokens = sum(map(len, recompute_generate(engine, workload.prompts[:k], caps, ns.temperature)))
        note = f"short run: first {k} requests, <= {ns.naive_max_tokens} new tokens each"
    else:
        params = [SamplingParams(temperature=ns.temperature, max_tokens=m, ignore_eos=True)
                  for m in workload.max_tokens]
        chunk = batch if step.mode == "static" else len(workload.prompts)
        tokens = sum(num_output_tokens(generate(engine, workload.prompts[i:i + chunk], params[i:i + chunk]))
                     for i in range(0, len(workload.prompts), chunk))
        if step.mode == "static":
            note = f"batches of {batch}"
    elapsed = clock(engine.device) - start
    return {"output_tokens": tokens, "elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed, "note": note}


def run(ns: argparse.Namespace) -> dict[str, Any]:
    check_workload_args(ns, [ns.temperature], "--temperature")
    check_at_least(ns, {"naive_requests": 1, "naive_max_tokens": 1})
    base = engine_args_from(ns)
    rows: list[dict[str, Any]] = []
    header, engine, engine_key, workload = None, None, None, None
    measured: list[float] = []
    for step in ladder(pick_device(base.device), base.quantization):
        row: dict[str, Any] = {"step": step.name, "mode": step.mode, "kernels": step.kernels,
                               "cuda_graphs": step.cuda_graphs, "quantization": step.quantization}
        if step.skip:
            rows.append({**row, "note": step.skip})
            continue
        key = (step.kernels, step.cuda_graphs, step.quantization)
        if key != engine_key:
            engine = None
            release_memory()
            engine, engine_key = build_engine(step.engine_args(base), step.kernels), key
            workload = workload or workload_from(ns, engine.model_config.vocab_size)
            header = header or result_header("ablation", engine.args, engine.device, {
                "num_requests": ns.num_requests, "min_input_len": ns.min_input_len,
                "max_input_len": ns.max_input_len, "min_output_len": ns.min_output_len,
                "max_output_len": ns.max_output_len, "seed": ns.workload_seed, "temperature": ns.temperature,
                "batch_size": base.max_num_seqs, "naive_requests": ns.naive_requests,
                "naive_max_tokens": ns.naive_max_tokens})
            warm_up(engine)
        row.update(run_step(engine, step, workload, ns))
        tps = row["output_tokens_per_s"]
        row["gain_vs_previous"] = tps / measured[-1] if measured else 1.0
        row["gain_vs_first"] = tps / measured[0] if measured else 1.0
        measured.append(tps)
        rows.append(row)
    engine = None
    release_memory()
    print_table(rows, COLUMNS, title=f"from naive to fast: {ns.num_requests} requests, batch {base.max_num_seqs}, "
                                     f"temperature {ns.temperature}")
    result = {**header, "results": rows}
    save_json(result, ns.out)
    return result


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("ablation", help="the naive-to-fast ladder: recompute, KV cache, continuous batching, "
                                          "fused kernels, CUDA graphs (, quantization)")
    add_workload_args(p, num_requests=256)
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature; 0 = greedy (default: 0.6)")
    p.add_argument("--naive-requests", type=int, default=8,
                   help="requests of the recompute step's short run (default: %(default)s)")
    p.add_argument("--naive-max-tokens", type=int, default=32,
                   help="new tokens per request in the recompute step (default: %(default)s)")
    add_common_args(p)
    p.set_defaults(func=run, max_num_seqs=64)
