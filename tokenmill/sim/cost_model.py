"""How long one engine step takes, as a linear function of the batch the scheduler picked.

    t = c_step + c_prefill·prefill_tokens + c_decode·decode_tokens + c_ctx·decode_context + c_attn·prefill_attention

c_step holds the per-step overhead and the weight reads; c_prefill / c_decode the per-token matmul work and per-row
bookkeeping; decode_context is the KV tokens the decode rows attend to (memory traffic of decode attention);
prefill_attention the query-key pairs of the prefill chunks (the quadratic part of long prompts). The coefficients
come from `tokenmill simulate --fit` (least squares on the real engine's step times), or default to a roofline
estimate of the model on one H200, with bandwidths and FLOP/s calibrated on a fit of the real engine there.

The model is additive and blind to two things the fit averages out: on CUDA a pure decode step replays a CUDA graph
while a step with a prefill chunk runs eagerly (a small chunk beside a few decodes costs ~5 ms more than predicted on
the H200), and a step that samples nothing returns before the GPU is done, its time landing on the next step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.scheduler import SchedulerOutput
from tokenmill.plan import Plan

FEATURES = ("step", "prefill_tokens", "decode_tokens", "decode_context", "prefill_attention")


@dataclass
class StepShape:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_context: int = 0      # KV tokens read by the decode rows
    prefill_attention: int = 0   # query-key pairs of the prefill chunks

    def features(self) -> list[float]:
        return [1.0, self.prefill_tokens, self.decode_tokens, self.decode_context, self.prefill_attention]


def step_shape(out: SchedulerOutput) -> StepShape:
    """The shape of a scheduled step; call it before update_from_output moves num_computed_tokens."""
    shape = StepShape()
    for s in out.scheduled:
        r, n = s.request, s.num_new_tokens
        if r.num_computed_tokens < r.num_prompt_tokens:   # the scheduler's own prefill/decode split
            shape.prefill_tokens += n
            shape.prefill_attention += n * r.num_computed_tokens + n * (n + 1) // 2
        else:
            shape.decode_tokens += n
            shape.decode_context += r.num_computed_tokens + n
    return shape


@dataclass
class Hardware:
    """One H200 as this engine drives it: with these numbers the roofline below reproduces the coefficients `--fit`
    measured there for llama-3-8b in bf16 (docs/SIMULATOR.md)."""

    bandwidth: float = 3.5e12            # bytes/s reading weights (GEMV; 4.27 TB/s is the copy peak)
    kv_bandwidth: float = 1.87e12        # bytes/s reading KV in decode attention
    flops: float = 7.5e14                # FLOP/s of the linear layers (780 TFLOP/s is the bf16 matmul peak)
    attention_flops: float = 2.5e14      # FLOP/s of prefill attention
    step_overhead: float = 8e-4          # s of scheduling, batch building and launches per step
    decode_row_overhead: float = 7.5e-6  # s of per-request work (sampling, bookkeeping) per decode row
    memory: int = 143771 << 20           # bytes (143,771 MiB, as the driver reports it)


H200 = Hardware()


@dataclass
class CostModel:
    coefficients: dict[str, float]                       # seconds per unit of each feature
    meta: dict[str, Any] = field(default_factory=dict)   # where the numbers come from

    def step_time(self, shape: StepShape) -> float:
        return sum(self.coefficients.get(name, 0.0) * x for name, x in zip(FEATURES, shape.features()))

    @classmethod
    def roofline(cls, plan: Plan, num_layers: int, num_heads: int, head_dim: int, hw: Hardware = H200) -> CostModel:
        """Weights read once a step, 2 FLOPs per parameter per token, each attended KV token read once, and
        4·head_dim FLOPs per query-key pair and head."""
        per_token = 2 * plan.num_parameters / plan.tp / hw.flops
        return cls({
            "step": hw.step_overhead + plan.weight_bytes / hw.bandwidth,
            "prefill_tokens": per_token,
            "decode_tokens": per_token + hw.decode_row_overhead,
            "decode_context": plan.kv_bytes_per_token / hw.kv_bandwidth,
            "prefill_attention": 4 * num_layers * (num_heads // plan.tp) * head_dim / hw.attention_flops,
        }, {"source": f"roofline of {plan.model} ({plan.weight_dtype}, tp {plan.tp}) on an H200-class device"})

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"coefficients": self.coefficients, "meta": self.meta}, f, indent=2)

    @classmethod
    def load(cls, path: str) -> CostModel:
        with open(path) as f:
            d = json.load(f)
        coefficients = d.get("coefficients") if isinstance(d, dict) else None
        if not isinstance(coefficients, dict) or set(coefficients) - set(FEATURES) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in coefficients.values()):
            raise ValueError(f"{path} is not a cost model: expected {{'coefficients': {{{', '.join(FEATURES)}}}}}")
        return cls(coefficients, d.get("meta", {}))
