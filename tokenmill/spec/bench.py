"""Speculative vs plain decoding at batch 1, greedy: `python -m tokenmill.spec.bench`.

Two workloads: input-grounded (summarize, quote, edit a given passage: the output reuses the input, so n-gram
lookup finds its drafts there) and free-form chat (little to look up: the adaptive rule must keep speculation
from costing time). Each repetition runs every prompt on the plain and the speculative engine back to back,
alternating which goes first, so machine noise hits both alike; the speedup is the median over repetitions
of the per-repetition ratio of tokens/s. Greedy outputs are compared token for token.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch

from tokenmill import LLM, SamplingParams

PASSAGE = (
    "The old lighthouse on Marrow Point was built in 1821 by the harbour authority, after three merchant ships "
    "were lost on the rocks in a single winter. Its first keeper, Elias Brand, lived in the tower with his wife "
    "and four children. Every evening he climbed the one hundred and twelve steps to trim the wick and polish the "
    "great lens, and every morning he wrote the weather, the passing ships and the state of the light in a "
    "leather logbook. The logbooks survive: forty-one volumes, now kept in the town museum, record storms, "
    "shipwrecks and rescues, but also small things, such as the day the children found a seal pup on the beach. "
    "In 1954 the light was automated and the last keeper left. Today the tower is a museum, and visitors can "
    "climb the same steps that Elias Brand climbed every night for thirty years.")

GROUNDED = [
    f"Summarize the following text, reusing its wording where you can.\n\n{PASSAGE}",
    f"Quote the sentences of this text that mention the logbooks, word for word.\n\n{PASSAGE}",
    f"Rewrite this text in the present tense, keeping everything else the same.\n\n{PASSAGE}",
]
CHAT = [
    "Write a short story about a robot who learns to paint.",
    "Give me five tips for staying focused while working from home.",
    "Explain how vaccines train the immune system.",
]


@dataclass
class Result:
    rates: dict[str, list[float]] = field(default_factory=dict)   # engine -> tokens/s per repetition
    identical: bool = True
    stats: dict[str, float] = field(default_factory=dict)


def encode(llm: LLM, prompts: list[str]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in prompts]


def spec_counters(llm: LLM) -> dict[str, float]:
    s = llm.llm_engine.get_stats()
    return {k: s[k] for k in ("spec_num_verifications", "spec_num_draft_tokens", "spec_num_accepted_tokens")}


def run(engines: dict[str, LLM], prompts: list[list[int]], params: SamplingParams, reps: int) -> Result:
    res = Result({name: [] for name in engines})
    spec = engines["spec"]
    before = spec_counters(spec)
    for rep in range(reps):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        tokens = dict.fromkeys(engines, 0)
        seconds = dict.fromkeys(engines, 0.0)
        for ids in prompts:
            outs = {}
            for name in order:
                t0 = time.perf_counter()
                out = engines[name].generate([ids], params)[0].outputs[0]
                seconds[name] += time.perf_counter() - t0
                tokens[name] += len(out.token_ids)
                outs[name] = out.token_ids
            res.identical &= outs["plain"] == outs["spec"]
        for name in engines:
            res.rates[name].append(tokens[name] / seconds[name])
    after = spec_counters(spec)
    d = {k: after[k] - before[k] for k in after}
    n = d["spec_num_verifications"]
    res.stats = {"acceptance_rate": d["spec_num_accepted_tokens"] / max(d["spec_num_draft_tokens"], 1),
                 "mean_accepted_length": (d["spec_num_accepted_tokens"] + n) / n if n else 0.0}
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--speculative", default="ngram", help="ngram | draft:<model>[@<quantization>]")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-adaptive", action="store_true", help="always propose K tokens (the raw mechanism)")
    p.add_argument("--dtype", default="float32", help="both engines' dtype (default: %(default)s)")
    p.add_argument("--quantization", default=None, help="both engines' weight quantization, e.g. gguf")
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    common = dict(dtype=ns.dtype, quantization=ns.quantization)
    engines = {"plain": LLM(ns.model, **common),
               "spec": LLM(ns.model, **common, speculative=ns.speculative,
                           num_speculative_tokens=ns.num_speculative_tokens)}
    engines["spec"].llm_engine.spec.adaptive = not ns.no_adaptive
    params = SamplingParams(temperature=0, max_tokens=ns.max_tokens)
    warm = SamplingParams(temperature=0, max_tokens=8)
    for llm in engines.values():
        llm.generate(encode(llm, ["Hello!"]), warm)
    print(f"speculative={ns.speculative} K={ns.num_speculative_tokens} adaptive={not ns.no_adaptive} "
          f"dtype={ns.dtype} quantization={ns.quantization} threads={torch.get_num_threads()} "
          f"max_tokens={ns.max_tokens} reps={ns.reps}")
    print(f"{'workload':<10} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} {'accept':>7} "
          f"{'mean len':>8}  identical")
    for name, prompts in (("grounded", GROUNDED), ("chat", CHAT)):
        res = run(engines, encode(engines["plain"], prompts), params, ns.reps)
        ratios = [s / p for s, p in zip(res.rates["spec"], res.rates["plain"])]
        plain, spec = statistics.median(res.rates["plain"]), statistics.median(res.rates["spec"])
        print(f"{name:<10} {plain:>11.2f} {spec:>10.2f} {statistics.median(ratios):>7.2f}x "
              f"{res.stats['acceptance_rate']:>7.2f} {res.stats['mean_accepted_length']:>8.2f}  {res.identical}")


if __name__ == "__main__":
    main()
