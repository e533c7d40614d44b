"""`tokenmill simulate`: options -> workload, cost model, pool size(s) -> simulator -> report; and `--fit`.

Scheduler and cache options are the engine's own flags (add_engine_args), so a simulated configuration is passed
unchanged to `tokenmill serve`, and `--fit` profiles exactly the engine those flags build."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import torch

from tokenmill.config import EngineArgs, ModelConfig, SchedulerConfig, parse_dtype
from tokenmill.engine.arg_utils import add_engine_args, check_at_least, engine_args_from
from tokenmill.units import parse_bytes
from tokenmill.model.presets import PRESETS, get_preset
from tokenmill.plan import Plan, make_plan, resolve_model_config
from tokenmill.sim.cost_model import FEATURES, H200, CostModel
from tokenmill.sim.report import format_report, format_sweep, plot
from tokenmill.sim.simulator import SimResult, Simulator
from tokenmill.sim.workload import RequestClass, generate, parse_class, special_ids

DEFAULT_COST_MODEL = "cost_model.json"
_PLAN_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_slos(pairs: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds), as `bench serve --goodput`."""
    slos = {}
    for pair in pairs or []:
        name, _, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if name not in ("ttft", "tpot", "e2el") or not ms >= 0:
            raise ValueError(f"--goodput takes NAME:MILLISECONDS with NAME in ttft, tpot, e2el and "
                             f"MILLISECONDS >= 0; got {pair!r}")
        slos[name] = ms
    return slos


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("simulate", help="simulate the scheduler under a workload with a fitted cost model")
    w = p.add_argument_group("workload (the random dataset of `bench serve`, or several --class mixtures)")
    w.add_argument("--num-prompts", type=int, default=200, help="requests (default %(default)s)")
    w.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf = all at once (default)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    w.add_argument("--random-input-len", type=int, default=1024, help="mean prompt tokens (default %(default)s)")
    w.add_argument("--random-output-len", type=int, default=128, help="mean output tokens (default %(default)s)")
    w.add_argument("--random-range-ratio", type=float, default=0.0, help="uniform lengths within ±ratio of the mean")
    w.add_argument("--random-prefix-len", type=int, default=0, help="random prefix shared by all prompts of a class")
    w.add_argument("--dist", default="uniform", choices=("uniform", "lognormal"), help="length distribution")
    w.add_argument("--class", dest="classes", action="append", default=None, metavar="NAME:KEY=VALUE,...",
                   help="a request class (repeatable), keys n, rate, burstiness, start, in, out, range, prefix, "
                        "priority, dist; unset keys take the flags above. "
                        "e.g. short:n=300,rate=5,in=128,out=64,priority=0")
    w.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    s = p.add_argument_group("simulation")
    s.add_argument("--cost-model", default=None, help="cost model JSON from --fit (default: H200 roofline estimate)")
    s.add_argument("--num-blocks", type=_ints, default=None,
                   help="KV pool size(s) in blocks, as --num-gpu-blocks-override (block 0 is the null block); "
                        "a comma list sweeps")
    s.add_argument("--kv-tokens", type=_ints, default=None, help="KV pool size(s) in tokens; a comma list sweeps")
    s.add_argument("--memory", type=parse_bytes, default=H200.memory,
                   help="device memory for the default pool, sized by the planner (default: an H200, 143771MiB)")
    s.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    s.add_argument("--plot", default=None, metavar="PNG", help="write KV usage, queues and latency CDFs here")
    s.add_argument("--compare-real", action="store_true", help="also run the workload on the real engine")
    f = p.add_argument_group("fitting (--fit profiles the engine the engine options build)")
    f.add_argument("--fit", action="store_true", help=f"fit the cost model, write --cost-model "
                                                      f"(default {DEFAULT_COST_MODEL}) and exit")
    f.add_argument("--fit-batch-sizes", type=_ints, default=[1, 4, 16], help="comma list (default 1,4,16)")
    f.add_argument("--fit-prompt-lens", type=_ints, default=[32, 256, 1024], help="comma list (default 32,256,1024)")
    f.add_argument("--fit-output-len", type=int, default=16, help="new tokens per profiled request (default 16)")
    add_engine_args(p)
    p.set_defaults(func=run)


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    """The engine flags, with a preset name accepted as --model (random weights of that architecture)."""
    args = engine_args_from(ns)
    if args.model in PRESETS and not os.path.exists(args.model):
        args = dataclasses.replace(args, model=None, load_format="dummy", model_preset=args.model)
    return args


def model_config(args: EngineArgs) -> tuple[str, ModelConfig]:
    if args.model_preset is not None:
        return args.model_preset, get_preset(args.model_preset)
    return resolve_model_config(args.model)


def scheduler_config(args: EngineArgs, config: ModelConfig) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len or config.max_position_embeddings, policy=args.scheduling_policy,
        max_queue_len=args.max_queue_len, long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_long_partial_prefills=args.max_long_partial_prefills, priority_aging_s=args.priority_aging_s,
        timeout_s=args.timeout_s)


def plan_for(args: EngineArgs, label: str, config: ModelConfig, memory: int) -> Plan:
    """The planner's view of the engine flags: quantization, compute and KV dtypes, TP, batch limits."""
    weight = args.quantization or ("auto" if args.dtype == "auto" else _PLAN_DTYPES[parse_dtype(args.dtype)])
    return make_plan(label, config, memory, weight, args.kv_cache_dtype, args.max_model_len,
                     args.tensor_parallel_size, args.gpu_memory_utilization, args.block_size,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)


def load_cost_model(path: str) -> CostModel:
    """CostModel.load, with a file that is not JSON refused by name (json's own error names no file)."""
    try:
        return CostModel.load(path)
    except OSError as e:
        raise ValueError(f"--cost-model {path} cannot be read ({e.strerror}); give the JSON file "
                         "`tokenmill simulate --fit` writes") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        reason = "nested too deep" if isinstance(e, RecursionError) else e
        raise ValueError(f"--cost-model {path} is not JSON ({reason}); expected a cost model as `tokenmill simulate --fit` "
                         f"writes it: {{'coefficients': {{{', '.join(FEATURES)}}}}}") from None


def pool_sizes(ns: argparse.Namespace, args: EngineArgs, plan: Plan, cost: CostModel,
               engine_blocks: int | None) -> list[int]:
    """Blocks (null block included) to simulate: --num-blocks, --kv-tokens, the engine flags, the real engine's
    pool (--compare-real), the fitted engine's pool, else what the planner leaves on --memory."""
    if ns.num_blocks:
        return ns.num_blocks
    if ns.kv_tokens:
        return [math.ceil(t / args.block_size) + 1 for t in ns.kv_tokens]
    if args.num_gpu_blocks_override:
        return [args.num_gpu_blocks_override]
    # as ModelRunner._num_blocks: a budget in bytes never buys more than max_num_seqs full contexts
    most = 1 + args.max_num_seqs * math.ceil(plan.max_model_len / args.block_size)
    if args.kv_cache_memory:
        return [min(args.kv_cache_memory // (plan.kv_bytes_per_token * args.block_size), most)]
    if engine_blocks is not None:
        return [engine_blocks]
    if cost.meta.get("num_blocks") and cost.meta.get("block_size") == args.block_size:
        return [int(cost.meta["num_blocks"])]
    if not plan.fits:
        raise ValueError(f"{plan.model} does not fit in {ns.memory} bytes ({plan.reason}); "
                         "pass --memory, --num-blocks or --kv-tokens")
    return [min(plan.kv_blocks + 1, most)]


def workload_classes(ns: argparse.Namespace) -> list[RequestClass]:
    defaults = RequestClass("all", ns.num_prompts, ns.request_rate, ns.burstiness, 0.0, ns.random_input_len,
                            ns.random_output_len, ns.random_range_ratio, ns.random_prefix_len, 0, ns.dist)
    return [parse_class(c, defaults) for c in ns.classes] if ns.classes else [defaults]


def check_args(ns: argparse.Namespace) -> None:
    """The workload, pool and fit options, checked before anything is built, so that a bad count is a clear error
    rather than an IndexError in the report (no prompts) or in the profile (no fit batch). A class of n=0 is
    allowed in a mix (a class switched off), but a workload without any request has nothing to report."""
    check_at_least(ns, {"num_prompts": 1, "random_input_len": 1, "random_output_len": 1, "random_prefix_len": 0,
                        "seed": 0, "kv_tokens": 1, "memory": 1, "fit_batch_sizes": 1, "fit_prompt_lens": 1,
                        "fit_output_len": 1})
    for dest in ("fit_batch_sizes", "fit_prompt_lens"):
        if not getattr(ns, dest):
            raise ValueError(f"--{dest.replace('_', '-')} needs at least one value")
    if ns.num_blocks and ns.kv_tokens:  # --num-blocks won and --kv-tokens was dropped without a word
        raise ValueError("give the KV pool one way: --num-blocks or --kv-tokens, not both")
    if ns.classes and not sum(c.num_requests for c in workload_classes(ns)):
        raise ValueError("the workload has no requests: every --class has n=0")


def run(ns: argparse.Namespace) -> list[SimResult]:
    from tokenmill.engine.llm_engine import LLMEngine
    check_args(ns)
    args = engine_args(ns)
    if ns.fit:
        from tokenmill.sim.fit import fit_engine
        cost = fit_engine(LLMEngine(args), ns.fit_batch_sizes, ns.fit_prompt_lens, ns.fit_output_len, ns.seed)
        path = ns.cost_model or DEFAULT_COST_MODEL
        cost.save(path)
        print("\n".join(f"{k:<18} {v:.4g} s" for k, v in cost.coefficients.items()))
        print(f"fitted on {cost.meta['num_steps']} steps ({cost.meta['num_outliers']} outliers dropped), median "
              f"relative error {cost.meta['median_rel_error']:.1%}; written to {path}")
        return []
    label, config = model_config(args)
    plan = plan_for(args, label, config, ns.memory)
    cost = load_cost_model(ns.cost_model) if ns.cost_model else CostModel.roofline(
        plan, config.num_hidden_layers, config.num_attention_heads, config.head_dim)
    workload = generate(workload_classes(ns), config.vocab_size, special_ids(config), ns.seed)
    slos = parse_slos(ns.goodput)
    engine = LLMEngine(args) if ns.compare_real else None
    sched_config = scheduler_config(args, config)
    results = []
    for num_blocks in pool_sizes(ns, args, plan, cost, engine.kv_cache.num_blocks if engine else None):
        sim = Simulator(sched_config, num_blocks, args.block_size, cost, args.enable_prefix_caching, args.timeout_s)
        results.append(sim.run(workload))
    title = f"simulated: {label}, policy {args.scheduling_policy}, cost model {cost.meta.get('source', '?')}"
    if len(results) == 1:
        print(format_report(results[0], slos, title))
    else:
        print(format_sweep(results, slos, title))
    if ns.plot:
        for r in results:
            root, ext = os.path.splitext(ns.plot)
            plot(r, ns.plot if len(results) == 1 else f"{root}-{r.usable_blocks + 1}{ext}", title)
    if engine is not None:
        from tokenmill.sim.replay import replay
        real = replay(engine, workload)[0]
        print()
        print(format_report(real, slos, f"real engine: {label} on {engine.device}"))
        results.append(real)
    return results
