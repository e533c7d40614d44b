"""`tokenmill plan`: will a model fit on a device, and how many tokens of KV cache are left?

Arithmetic only, from the architecture (a preset, a config.json folder or a GGUF header), so a 70B model can be
sized without its checkpoint. Per tensor-parallel rank: weights (linear layers in the weight dtype with their
quantization scales; embeddings, LM head and norms in the compute dtype), an activation/workspace reserve for the
largest step, and what is left of `memory × utilization` becomes KV cache, at
2 × layers × kv_heads × head_dim × bytes per token (plus scales for int8)."""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass

from tokenmill.config import ModelConfig
from tokenmill.quant.formats import DEFAULT_INT4_GROUP, QuantFormat

# bytes per element
WEIGHT_DTYPES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5}
KV_DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
KV_SCALE_BYTES = 4          # one float32 scale per (token, KV head) for each of K and V in an int8 cache
WORKSPACE_BYTES = 1 << 30   # CUDA context, cuBLAS/Triton workspaces, CUDA graph pools
_HF_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def resolve_model_config(model: str | None) -> tuple[str, ModelConfig]:
    """A preset name, a Hugging Face folder or a .gguf file (None: the default model) -> (label, config)."""
    from tokenmill.model.loader import load_model_config, resolve_model
    from tokenmill.model.presets import PRESETS, get_preset
    if model is not None and model in PRESETS and not os.path.exists(model):
        return model, get_preset(model)
    path = resolve_model(model)
    return os.path.basename(path.rstrip("/")), load_model_config(path)


def compute_dtype(weight_dtype: str) -> str:
    """Quantized weights compute (and keep embeddings, norms, LM head) in bf16."""
    return weight_dtype if weight_dtype in ("fp32", "fp16", "bf16") else "bf16"


def auto_weight_dtype(config: ModelConfig) -> str:
    """What the engine's "auto" picks on a GPU (engine/devices.pick_dtype): a 16-bit checkpoint's dtype, else
    bf16 (float32 checkpoints too)."""
    return _HF_DTYPES[config.torch_dtype] if config.torch_dtype in ("float16", "bfloat16") else "bf16"


def kv_heads_per_rank(config: ModelConfig, tp: int) -> int:
    """KV heads are split over ranks, and replicated (one per rank) when there are fewer heads than ranks."""
    kv = config.num_key_value_heads
    if config.num_attention_heads % tp:
        raise ValueError(f"--tp {tp} must divide the {config.num_attention_heads} attention heads")
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"--tp {tp} and the {kv} KV heads must divide one another")
    return max(1, kv // tp)


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str, tp: int = 1) -> int:
    """KV bytes one token occupies on one rank: K and V for every layer and local KV head (+ int8 scales)."""
    heads = kv_heads_per_rank(config, tp)
    per_head = config.head_dim * KV_DTYPES[kv_dtype] + (KV_SCALE_BYTES if kv_dtype == "int8" else 0)
    return 2 * config.num_hidden_layers * heads * per_head


def linear_shapes(config: ModelConfig, tp: int = 1) -> list[tuple[int, int]]:
    """(out_features, in_features) of one rank's linear layers in one decoder layer."""
    h, d = config.hidden_size, config.head_dim
    q = config.num_attention_heads // tp * d
    kv = kv_heads_per_rank(config, tp) * d
    ffn = math.ceil(config.intermediate_size / tp)
    return [(q, h), (kv, h), (kv, h), (h, q), (ffn, h), (ffn, h), (h, ffn)]


def num_parameters(config: ModelConfig) -> int:
    """Parameters of the whole model (tp = 1)."""
    embed = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return embed + config.num_hidden_layers * _layer_params(config, 1) + config.hidden_size


def _layer_params(config: ModelConfig, tp: int) -> int:
    shapes = linear_shapes(config, tp)
    n = sum(o * i for o, i in shapes) + 2 * config.hidden_size
    if config.attention_bias:
        n += shapes[0][0] + 2 * shapes[1][0]
    if config.qk_norm:
        n += 2 * config.head_dim
    return n


def weight_bytes(config: ModelConfig, weight_dtype: str, tp: int = 1, group_size: int = 128,
                 quantize_lm_head: bool = False) -> int:
    """One rank's weight bytes. int8 / fp8 / int4 count what QuantLinear holds: packed values (INT4 rows padded
    to 32 inputs), a scale per output channel (int8: fp16, fp8: float32) or a scale and a min per group (int4); with
    quantize_lm_head the LM head too (its own packed copy where tied; the embedding stays 16-bit)."""
    act = WEIGHT_DTYPES[compute_dtype(weight_dtype)]
    shapes = linear_shapes(config, tp)
    linear = sum(o * i for o, i in shapes)
    formats = {"int8": QuantFormat(8), "fp8": QuantFormat(8, fp8=True), "int4": QuantFormat(4, group_size)}
    fmt = formats.get(weight_dtype)
    if quantize_lm_head and fmt is None:
        raise ValueError(f"--quantize-lm-head needs an int8, fp8 or int4 weight dtype, got {weight_dtype!r}")
    linear_bytes = sum(fmt.nbytes(o, i) for o, i in shapes) if fmt else linear * WEIGHT_DTYPES[weight_dtype]
    other = _layer_params(config, tp) - linear           # norms, biases: compute dtype
    vocab_rows = math.ceil(config.vocab_size / tp)
    head = 0 if config.tie_word_embeddings else vocab_rows * config.hidden_size * act
    if quantize_lm_head:
        head = fmt.nbytes(vocab_rows, config.hidden_size)
    embed = vocab_rows * config.hidden_size * act
    return int(config.num_hidden_layers * (linear_bytes + other * act) + embed + head + config.hidden_size * act)


def activation_bytes(config: ModelConfig, weight_dtype: str, tp: int, max_num_batched_tokens: int,
                     max_num_seqs: int) -> int:
    """Peak activations of the largest step (a few hidden-sized buffers, q/k/v, gate+up) plus float32 logits
    and probabilities of every sampled row, plus a fixed workspace."""
    (q, _), (kv, _) = linear_shapes(config, tp)[:2]
    ffn = math.ceil(config.intermediate_size / tp)
    per_token = 4 * config.hidden_size + q + 2 * kv + 3 * ffn
    logits = 2 * min(max_num_seqs, max_num_batched_tokens) * config.vocab_size * 4
    act = WEIGHT_DTYPES[compute_dtype(weight_dtype)]
    return int(max_num_batched_tokens * per_token * act) + logits + WORKSPACE_BYTES


@dataclass
class Plan:
    model: str
    num_parameters: int
    tp: int
    weight_dtype: str
    kv_dtype: str
    memory_bytes: int
    usable_bytes: int
    weight_bytes: int
    activation_bytes: int
    kv_bytes_per_token: int
    kv_heads_per_rank: int
    kv_budget_bytes: int
    kv_tokens: int
    kv_blocks: int
    block_size: int
    max_model_len: int
    avg_context: int
    max_concurrent: int
    max_concurrent_full: int
    fits: bool
    reason: str


def _check_sizes(memory: int, gpu_memory_utilization: float, block_size: int, max_model_len: int | None,
                 avg_context: int | None, max_num_batched_tokens: int, max_num_seqs: int) -> None:
    """The sizes the arithmetic divides by or counts with: a zero block size or a negative context would divide by
    zero, a negative memory or utilization would give a plan that reads as if it meant something; and a block size
    the engine refuses would plan an engine that cannot be started."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    for flag, value in (("--memory", memory), ("--block-size", block_size), ("--max-model-len", max_model_len),
                        ("--avg-context", avg_context), ("--max-num-batched-tokens", max_num_batched_tokens),
                        ("--max-num-seqs", max_num_seqs)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if block_size & (block_size - 1):  # the engine's rule and message (EngineArgs)
        raise ValueError(f"block_size must be a power of two >= 1, got {block_size}")


def make_plan(label: str, config: ModelConfig, memory: int, weight_dtype: str = "auto", kv_dtype: str = "auto",
              max_model_len: int | None = None, tp: int = 1, gpu_memory_utilization: float = 0.9,
              block_size: int = 16, avg_context: int | None = None, max_num_batched_tokens: int = 2048,
              max_num_seqs: int = 256, group_size: int | None = None, quantize_lm_head: bool = False) -> Plan:
    """group_size: INT4's (default 128); naming one for another weight dtype is an error (it would change nothing)."""
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    _check_sizes(memory, gpu_memory_utilization, block_size, max_model_len, avg_context, max_num_batched_tokens,
                 max_num_seqs)
    weight_dtype = auto_weight_dtype(config) if weight_dtype == "auto" else weight_dtype
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {weight_dtype!r} is not one of auto, {', '.join(WEIGHT_DTYPES)}")
    if group_size is not None and weight_dtype != "int4":
        raise ValueError(f"--group-size applies to int4 weights; the weight dtype is {weight_dtype}")
    kv_dtype = compute_dtype(weight_dtype) if kv_dtype == "auto" else kv_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"KV dtype {kv_dtype!r} is not one of auto, {', '.join(KV_DTYPES)}")
    max_len = max_model_len or config.max_position_embeddings
    if max_len > config.max_position_embeddings:  # the engine's rule and message (LLMEngine)
        raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")
    if avg_context is not None and avg_context > max_len:  # no request holds more than the context
        raise ValueError(f"--avg-context {avg_context} exceeds max_model_len={max_len}: a request holds at most "
                         "its context; give a smaller average or a longer --max-model-len")
    avg = avg_context or max(1, max_len // 4)
    usable = int(memory * gpu_memory_utilization)
    weights = weight_bytes(config, weight_dtype, tp, DEFAULT_INT4_GROUP if group_size is None else group_size,
                           quantize_lm_head)
    # the largest step: the whole token budget, as several prompts where it exceeds one context (the engine's
    # memory profile runs the same batch: runner/model_runner.worst_case_prefill)
    acts = activation_bytes(config, weight_dtype, tp, min(max_num_batched_tokens, max_num_seqs * max_len),
                            max_num_seqs)
    per_token = kv_bytes_per_token(config, kv_dtype, tp)
    budget = max(0, usable - weights - acts)
    blocks = budget // (per_token * block_size)
    tokens = blocks * block_size
    if weights > usable:
        fits, reason = False, "the weights alone exceed the usable memory"
    elif blocks < math.ceil(max_len / block_size):
        fits, reason = False, f"KV room for {tokens} tokens, less than one request of max_model_len {max_len}"
    else:
        fits, reason = True, ""
    return Plan(label, num_parameters(config), tp, weight_dtype, kv_dtype, memory, usable, weights, acts, per_token,
                kv_heads_per_rank(config, tp), budget, tokens, blocks, block_size, max_len, avg,
                blocks // math.ceil(avg / block_size), blocks // math.ceil(max_len / block_size), fits, reason)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB ({n / 2**30:.2f} GiB)"


def format_plan(p: Plan, config: ModelConfig) -> str:
    scale = f" + {KV_SCALE_BYTES} B scale" if p.kv_dtype == "int8" else ""
    kv_desc = (f"2 x {config.num_hidden_layers} layers x {p.kv_heads_per_rank} KV heads x "
               f"({config.head_dim} x {KV_DTYPES[p.kv_dtype]} B{scale})")
    rows = [
        ("model", f"{p.model} ({config.architecture}, {p.num_parameters / 1e9:.2f} B parameters)"),
        ("tensor parallel", f"{p.tp} rank(s); figures below are per rank"),
        ("memory", f"{_gb(p.memory_bytes)} x utilization = {_gb(p.usable_bytes)}"),
        ("weights", f"{_gb(p.weight_bytes)} ({p.weight_dtype})"),
        ("activations", f"{_gb(p.activation_bytes)} reserved (largest step + {WORKSPACE_BYTES >> 30} GiB workspace)"),
        ("KV per token", f"{p.kv_bytes_per_token:,} B ({p.kv_dtype}: {kv_desc})"),
        ("KV cache", f"{_gb(p.kv_budget_bytes)} = {p.kv_tokens:,} tokens = {p.kv_blocks:,} blocks of {p.block_size}"),
        ("max concurrent", (f"{p.max_concurrent:,} requests at {p.avg_context:,} tokens of context; "
                            f"{p.max_concurrent_full:,} at max_model_len {p.max_model_len:,}")),
        ("fits", "yes" if p.fits else f"NO: {p.reason}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from tokenmill.units import parse_bytes
    p = subparsers.add_parser("plan", help="capacity planner: weights, KV bytes per token, KV capacity, fit")
    p.add_argument("--model", default=None, help="HF folder, .gguf file or preset name (default: the default model)")
    p.add_argument("--memory", type=parse_bytes, default=parse_bytes("80GiB"), help="memory per device (default 80GiB)")
    p.add_argument("--weight-dtype", default="auto", help=f"auto | {' | '.join(WEIGHT_DTYPES)} (default: checkpoint's)")
    p.add_argument("--kv-dtype", default="auto", help=f"auto | {' | '.join(KV_DTYPES)} (auto: the compute dtype)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of memory used (default 0.9)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--avg-context", type=int, default=None, help="average tokens per request (default max_model_len/4)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step (default 2048)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="maximum running requests (default 256)")
    p.add_argument("--group-size", type=int, default=None, help="int4 quantization group size (default 128)")
    p.add_argument("--quantize-lm-head", action="store_true", help="int8 / fp8 / int4: the LM head quantized too")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> Plan:
    label, config = resolve_model_config(ns.model)
    plan = make_plan(label, config, ns.memory, ns.weight_dtype, ns.kv_dtype, ns.max_model_len, ns.tp,
                     ns.gpu_memory_utilization, ns.block_size, ns.avg_context, ns.max_num_batched_tokens,
                     ns.max_num_seqs, ns.group_size, ns.quantize_lm_head)
    print(json.dumps(asdict(plan), indent=2) if ns.json else format_plan(plan, config))
    return plan
