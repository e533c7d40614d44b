"""`tokenmill simulate --fit`: measure the real engine's step times over a range of batch shapes and fit the cost
model's coefficients by least squares.

The profile is a series of phases, one for every B in batch_sizes and P in prompt_lens: B requests of P prompt
tokens and `output_len` new tokens arrive at once. That covers prefills of one or many prompts, chunked ones, mixed
steps where the budget splits between late prompts and early decodes, and decode batches of every size at short
and long contexts. The fit is least squares on the relative error (step times span three orders
of magnitude and the short decode steps set TPOT), keeps every coefficient >= 0, and refits once without gross
outliers (a busy machine's hiccups)."""
from __future__ import annotations

import datetime
import os
import platform

import numpy as np

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sim.cost_model import FEATURES, CostModel, StepShape
from tokenmill.sim.replay import StepTrace, add
from tokenmill.sim.workload import RequestClass, SimRequest, generate, special_ids

IRLS_ROUNDS = 4        # reweighting rounds of the least squares
OUTLIER_FACTOR = 4.0   # a step off by this many times the median relative error, and by at least
MIN_OUTLIER = 1.0      # this much (twice the predicted time), is dropped


def profile_phases(batch_sizes: list[int], prompt_lens: list[int], output_len: int, vocab_size: int,
                   special_ids: set[int], seed: int = 0) -> list[list[SimRequest]]:
    phases = []
    for b in batch_sizes:
        for p in prompt_lens:
            c = RequestClass(name=f"b{b}p{p}", num_requests=b, input_len=p, output_len=output_len)
            phases.append(generate([c], vocab_size, special_ids, seed + len(phases)))
    return phases


def profile(engine: LLMEngine, phases: list[list[SimRequest]]) -> list[tuple[StepShape, float]]:
    """(shape, seconds) of every step of every phase, after a warm-up request whose steps are thrown away."""
    samples: list[tuple[StepShape, float]] = []
    with StepTrace(engine) as trace:
        for phase in [[SimRequest("warmup", "warmup", 0.0, phases[0][0].prompt_token_ids, 4, 0)]] + phases:
            for r in phase:
                add(engine, r)
            while engine.has_unfinished_requests():
                if (sample := trace.step()) is not None and phase[0].request_id != "warmup":
                    samples.append(sample)
    return samples


def _nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0: drop the most negative coefficient until none is left (enough for a handful)."""
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        x[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if x.min() >= 0:
            return x
        active.remove(int(np.argmin(x)))


def _weighted_lstsq(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least squares with each step weighted by 1/predicted (iterated from 1/measured): the error is relative,
    yet the fit follows the *mean* step time at each shape, which is what latencies add up. (Weighting by
    1/measured instead would favour the steps that happened to run fast.)"""
    w = 1 / t
    for _ in range(IRLS_ROUNDS):
        coef = _nonneg_lstsq(x * w[:, None], t * w)
        w = 1 / np.maximum(x @ coef, 1e-9)
    return coef


def fit(samples: list[tuple[StepShape, float]], meta: dict | None = None) -> CostModel:
    """Fit the coefficients, then refit once without the outliers."""
    if len(samples) < len(FEATURES):
        raise ValueError(f"{len(samples)} profiled steps are too few to fit {len(FEATURES)} coefficients")
    x = np.array([s.features() for s, _ in samples])
    t = np.array([seconds for _, seconds in samples])
    rel = np.abs(t / np.maximum(x @ _weighted_lstsq(x, t), 1e-9) - 1)
    keep = rel <= max(OUTLIER_FACTOR * np.median(rel), MIN_OUTLIER)
    coef = _weighted_lstsq(x[keep], t[keep])
    rel = np.abs(t / np.maximum(x @ coef, 1e-9) - 1)
    info = {"source": "fit", "num_steps": len(samples), "num_outliers": int((~keep).sum()),
            "median_rel_error": float(np.median(rel[keep])),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(), **(meta or {})}
    return CostModel(dict(zip(FEATURES, coef.tolist())), info)


def fit_engine(engine: LLMEngine, batch_sizes: list[int], prompt_lens: list[int], output_len: int,
               seed: int = 0) -> CostModel:
    """Profile `engine` and fit; the engine's model, device, dtype and pool go into the model's meta."""
    phases = profile_phases(batch_sizes, prompt_lens, output_len, engine.model_config.vocab_size,
                            special_ids(engine.model_config), seed)
    model = os.path.basename(engine.model_path or "") or engine.args.model_preset
    meta = {"source": f"fitted on {model} ({engine.device}, {engine.dtype})".replace("torch.", ""),
            "model": engine.model_path or engine.args.model_preset, "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."), "num_blocks": engine.kv_cache.num_blocks,
            "block_size": engine.kv_cache.block_size, "batch_sizes": batch_sizes, "prompt_lens": prompt_lens,
            "output_len": output_len}
    return fit(profile(engine, phases), meta)
