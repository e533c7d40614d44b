"""`tokenmill bench compare-hf`: tokenmill against Hugging Face transformers `generate` on the same model, in one
process, so the ratio holds on a noisy machine. The default is BENCHMARKS.md's CPU real-model set (workload 5): the
default GGUF model, chat-templated questions of ~40 tokens, 128 new tokens, batch 1 and 32 concurrent (a left-padded
batch for transformers), transformers in float32 and bfloat16. With --load-format dummy (e.g. the llama-3-8b preset
on the GPU) both run random weights of the same shape on random prompts: transformers builds its model from the
config. Figures are output tokens / wall time of the whole generate call, medians of --repeats runs."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from tokenmill.bench.common import (add_common_args, build_engine, clock, generate, median, num_output_tokens,
                                    print_table, release_memory, result_header, save_json)
from tokenmill.bench.workloads import chat_prompts, random_prompt
from tokenmill.config import EngineArgs, ModelConfig, parse_dtype
from tokenmill.engine.arg_utils import check_at_least, engine_args_from
from tokenmill.engine.llm_engine import LLMEngine, pick_device
from tokenmill.model.gguf_loader import iter_gguf_weights
from tokenmill.model.hf_loader import iter_safetensors_weights
from tokenmill.model.loader import resolve_format, resolve_model
from tokenmill.sampling_params import SamplingParams


def bench_prompts(engine: LLMEngine, count: int, prompt_len: int) -> list[list[int]]:
    """Workload 5's chat prompts when the model has a chat template, else random ids of prompt_len tokens."""
    tok = engine.tokenizer
    if tok is not None and tok.chat_template:
        return chat_prompts(tok, count)
    return [random_prompt(prompt_len, engine.model_config.vocab_size, seed=i) for i in range(count)]


def time_tokenmill(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, repeats: int) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    speeds = []
    for _ in range(repeats):
        engine.reset_prefix_cache()  # repeats must not reuse the previous run's prompts
        start = clock(engine.device)
        tokens = num_output_tokens(generate(engine, prompts, params))
        speeds.append(tokens / (clock(engine.device) - start))
    return speeds


def build_hf_model(config: ModelConfig, args: EngineArgs, dtype: torch.dtype, device: torch.device,
                   attn_implementation: str) -> torch.nn.Module:
    """transformers' model class for the architecture, built from the config on `device` in `dtype`: random weights
    (transformers' init) for load_format dummy, else the checkpoint tokenmill loads, read by tokenmill's readers."""
    import transformers

    hf = config.to_hf_dict()
    hf_config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype,
                                                              attn_implementation=attn_implementation)
    if args.load_format != "dummy":
        path = resolve_model(args.model)
        fmt = resolve_format(path, args.load_format)
        weights = iter_gguf_weights(path) if fmt == "gguf" else iter_safetensors_weights(path)
        params = dict(model.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in params:
                    if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and config.tie_word_embeddings):
                        continue
                    raise ValueError(f"transformers' {type(model).__name__} has no parameter {name!r}")
                params[name].copy_(tensor)
                loaded.add(name)
        if missing := sorted(set(params) - loaded):
            raise ValueError(f"the checkpoint left {len(missing)} transformers parameters unset, e.g. {missing[:3]}")
    return model.eval()


@torch.inference_mode()
def time_hf(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, repeats: int, pad_id: int,
            device: torch.device) -> list[float]:
    """Greedy `generate` of exactly max_tokens new tokens per prompt, prompts left-padded into one batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def run(n: int) -> int:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=pad_id)
        return (out.shape[1] - width) * len(prompts)

    run(4)  # warm-up
    speeds = []
    for _ in range(repeats):
        start = clock(device)
        tokens = run(max_tokens)
        speeds.append(tokens / (clock(device) - start))
    return speeds


def run(ns: argparse.Namespace) -> dict[str, Any]:
    check_at_least(ns, {"batch_sizes": 1, "max_tokens": 1, "prompt_len": 1, "repeats": 1})
    args = engine_args_from(ns)
    device = pick_device(args.device)
    batch_sizes = ns.batch_sizes or ([1] if device.type == "cuda" else [1, 32])
    hf_dtypes = ns.hf_dtypes or (["bfloat16"] if device.type == "cuda" else ["float32", "bfloat16"])
    rows: list[dict[str, Any]] = []

    engine = build_engine(args)
    prompts = bench_prompts(engine, max(batch_sizes), ns.prompt_len)
    config, tm_dtype = engine.model_config, str(engine.dtype).removeprefix("torch.")
    tok = engine.tokenizer
    pad_id = next((i for i in [tok.pad_token_id, *tok.eos_token_ids] if i is not None), 0) if tok else 0
    engine_args = engine.args
    for b in batch_sizes:
        speeds = time_tokenmill(engine, prompts[:b], ns.max_tokens, ns.repeats)
        rows.append({"system": "tokenmill", "dtype": tm_dtype, "batch_size": b,
                     "output_tokens_per_s": median(speeds), "output_tokens_per_s_all": speeds})
    engine = None
    release_memory()  # on CUDA the engine's KV pool holds most of the memory

    for name in hf_dtypes:
        model = build_hf_model(config, args, parse_dtype(name), device, ns.hf_attn_implementation)
        for b in batch_sizes:
            speeds = time_hf(model, prompts[:b], ns.max_tokens, ns.repeats, pad_id, device)
            rows.append({"system": "transformers", "dtype": name, "batch_size": b,
                         "output_tokens_per_s": median(speeds), "output_tokens_per_s_all": speeds})
        model = None
        release_memory()

    ratios = [{"hf_dtype": name, "batch_size": b,
               "ratio": speed(rows, "tokenmill", tm_dtype, b) / speed(rows, "transformers", name, b)}
              for name in hf_dtypes for b in batch_sizes]
    print_summary(rows, ratios, batch_sizes, tm_dtype, hf_dtypes, ns)
    header = result_header("compare-hf", engine_args, device, {
        "batch_sizes": batch_sizes, "hf_dtypes": hf_dtypes, "max_tokens": ns.max_tokens, "repeats": ns.repeats,
        "prompt_lens": [len(p) for p in prompts], "hf_attn_implementation": ns.hf_attn_implementation})
    result = {**header, "results": rows, "ratios": ratios}
    save_json(result, ns.out)
    return result


def speed(rows: list[dict[str, Any]], system: str, dtype: str, batch_size: int) -> float:
    return next(r["output_tokens_per_s"] for r in rows
                if (r["system"], r["dtype"], r["batch_size"]) == (system, dtype, batch_size))


def print_summary(rows: list[dict[str, Any]], ratios: list[dict[str, Any]], batch_sizes: list[int], tm_dtype: str,
                  hf_dtypes: list[str], ns: argparse.Namespace) -> None:
    """One line per system: output tokens/s at each batch size, then tokenmill's speed-up over each baseline."""
    lines = [{"system": f"tokenmill {tm_dtype}", **{f"b{b}": speed(rows, "tokenmill", tm_dtype, b)
                                                  for b in batch_sizes}}]
    lines += [{"system": f"transformers {d}", **{f"b{b}": speed(rows, "transformers", d, b) for b in batch_sizes}}
              for d in hf_dtypes]
    lines += [{"system": f"tokenmill / transformers {d}",
               **{f"b{r['batch_size']}": f"x{r['ratio']:.2f}" for r in ratios if r["hf_dtype"] == d}}
              for d in hf_dtypes]
    print_table(lines, [("system", "system")] + [(f"b{b}", f"batch {b} tok/s") for b in batch_sizes],
                title=f"output tokens/s, {ns.max_tokens} new tokens, medians of {ns.repeats} runs")


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("compare-hf", help="tokenmill vs transformers generate on the same model, in one process")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help="concurrent requests / padded batch sizes (default: 1 32 on the CPU, 1 on CUDA)")
    p.add_argument("--hf-dtypes", nargs="+", default=None,
                   help="transformers dtypes (default: float32 bfloat16 on the CPU, bfloat16 on CUDA)")
    p.add_argument("--hf-attn-implementation", default="sdpa", help="transformers attention (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=40,
                   help="prompt tokens when the model has no chat template, e.g. dummy weights (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per figure; medians reported (default: %(default)s)")
    add_common_args(p)
    p.set_defaults(func=run)
