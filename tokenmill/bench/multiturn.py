"""`tokenmill bench multiturn`: workload 4 of ../shared/BENCHMARKS.md. Conversations of several turns, each
turn resending the whole history (a shared system prompt first, as chat apps send) plus a new user
message, run with prefix caching on and off in one process. Reports prompt tokens actually computed (the exact saving) and throughput."""
from __future__ import annotations

import argparse
import dataclasses
import random
import time
from typing import Any

from tokenmill.bench.common import add_common_args, build_engine, print_table, release_memory, result_header, save_json
from tokenmill.config import EngineArgs
from tokenmill.engine.arg_utils import check_at_least, engine_args_from
from tokenmill.sampling_params import SamplingParams


def run_conversations(args: EngineArgs, ns: argparse.Namespace) -> dict[str, Any]:
    """All conversations advance turn by turn together (a batch per turn), like concurrent chat users."""
    engine = build_engine(args)
    vocab = engine.model_config.vocab_size
    rng = random.Random(ns.seed)
    system = [rng.randrange(3, vocab) for _ in range(ns.system_len)]
    histories = [list(system) for _ in range(ns.num_conversations)]
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    prompt_tokens = computed = generated = 0
    start = time.perf_counter()
    for _ in range(ns.num_turns):
        ids = []
        for h in histories:
            h.extend(rng.randrange(3, vocab) for _ in range(ns.user_len))
            ids.append(engine.add_request(None, list(h), params))
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        for h, rid in zip(histories, ids):
            out = done[rid]
            prompt_tokens += len(out.prompt_token_ids)
            computed += len(out.prompt_token_ids) - out.num_cached_tokens
            generated += len(out.outputs[0].token_ids)
            h.extend(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    del engine
    release_memory()
    return {"prefix_caching": args.enable_prefix_caching, "prompt_tokens": prompt_tokens,
            "prefill_tokens_computed": computed, "generated_tokens": generated, "time_s": elapsed,
            "total_tokens_per_s": (prompt_tokens + generated) / elapsed}


def run(ns: argparse.Namespace) -> None:
    check_at_least(ns, {"num_conversations": 1, "num_turns": 1, "system_len": 0, "user_len": 1, "output_len": 1})
    base = engine_args_from(ns)
    rows = [run_conversations(dataclasses.replace(base, enable_prefix_caching=on), ns) for on in (False, True)]
    off, on = rows
    saving = 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
    speedup = on["total_tokens_per_s"] / off["total_tokens_per_s"]
    print_table(rows, [("prefix_caching", "prefix caching"), ("prompt_tokens", "prompt tokens"),
                       ("prefill_tokens_computed", "prefill computed"), ("generated_tokens", "generated"),
                       ("time_s", "time s"), ("total_tokens_per_s", "total tok/s")])
    print(f"prefill tokens computed cut by {saving:.1%}; throughput x{speedup:.2f}")
    result = result_header("multiturn", base, build_device(base), vars_of(ns))
    result["results"] = {"runs": rows, "prefill_saving": saving, "throughput_ratio": speedup}
    save_json(result, ns.out)


def build_device(args: EngineArgs):
    from tokenmill.engine.llm_engine import pick_device
    return pick_device(args.device)


def vars_of(ns: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(ns, k) for k in ("num_conversations", "num_turns", "system_len", "user_len", "output_len", "seed")}


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("multiturn", help="multi-turn chat with prefix caching on and off (workload 4)")
    p.add_argument("--num-conversations", type=int, default=8, help="concurrent conversations (default: %(default)s)")
    p.add_argument("--num-turns", type=int, default=5, help="turns per conversation (default: %(default)s)")
    p.add_argument("--system-len", type=int, default=200,
                   help="tokens of the system prompt every conversation starts with (default: %(default)s)")
    p.add_argument("--user-len", type=int, default=100, help="tokens of each new user message (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=100, help="tokens generated per turn (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    add_common_args(p)
    p.set_defaults(func=run)
