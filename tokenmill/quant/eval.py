"""How far a quantized model drifts from its unquantized self, on the pydoc_data corpus (corpus.py).

Both models run the same windows as independent sequences through the real paged attention (so a quantized
KV cache is exercised: written, then read back); per token we compare the full next-token distributions:
KL(base || quantized), top-1 agreement, and each model's perplexity. Every projection is quantized once, the
way `tokenmill quantize` would; sensitivity then swaps them in one at a time, the rest kept in float, and
ranks them by the KL each causes alone; a mixed plan keeps the K worst in 16-bit.
"""
from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from tokenmill.config import parse_dtype
from tokenmill.quant.corpus import WindowRunner, corpus_text, corpus_windows
from tokenmill.quant.formats import QuantFormat, QuantizedWeight
from tokenmill.quant.linear import to_quant_linear
from tokenmill.quant.loading import LM_HEAD, quantizable_modules, replace_module


@dataclass
class Comparison:
    num_tokens: int
    kl_mean: float
    kl_p99: float
    top1_agreement: float
    ppl_base: float
    ppl_quant: float

    @property
    def ppl_change(self) -> float:
        return self.ppl_quant / self.ppl_base - 1

    def to_dict(self) -> dict:
        return {**asdict(self), "ppl_change": self.ppl_change}


def token_kl(base: torch.Tensor, quant: torch.Tensor) -> torch.Tensor:
    """KL(base || quant) per row of two log-prob matrices."""
    return (base.exp() * (base - quant)).sum(-1).clamp_min(0)


def compare(windows: list[list[int]], base: list[torch.Tensor],
            quant: list[torch.Tensor]) -> tuple[Comparison, torch.Tensor]:
    """Metrics over all windows, and the per-token KL values."""
    kl = torch.cat([token_kl(b, q) for b, q in zip(base, quant)])
    top1 = torch.cat([b.argmax(-1) == q.argmax(-1) for b, q in zip(base, quant)]).float().mean()

    def ppl(lps: list[torch.Tensor]) -> float:
        nll = torch.cat([-lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0] for lp, ids in zip(lps, windows)])
        return math.exp(nll.double().mean().item())

    return Comparison(kl.numel(), kl.mean().item(), torch.quantile(kl.double(), 0.99).item(), top1.item(),
                      ppl(base), ppl(quant)), kl


@contextlib.contextmanager
def swapped(model: nn.Module, weights: dict[str, QuantizedWeight]) -> Iterator[None]:
    """The named projections replaced by QuantLinears holding `weights` for the duration, then put back."""
    originals = {name: m for name, m in quantizable_modules(model, LM_HEAD in weights).items() if name in weights}
    for name, module in originals.items():
        replace_module(model, name, to_quant_linear(module, weights[name].fmt, weights[name]))
    try:
        yield
    finally:
        for name, module in originals.items():
            replace_module(model, name, module)


def linear_bytes(model: nn.Module, quantized: dict[str, QuantFormat], lm_head: bool = False,
                 float_bytes: int = 2) -> int:
    """Bytes of every projection's weight (and the LM head's with lm_head): packed + scales where quantized,
    else 16-bit."""
    return sum(quantized[name].nbytes(*m.weight.shape) if name in quantized else m.weight.numel() * float_bytes
               for name, m in quantizable_modules(model, lm_head).items())


def layer_sensitivity(model: nn.Module, runner: WindowRunner, windows: list[list[int]], base: list[torch.Tensor],
                      weights: dict[str, QuantizedWeight]) -> list[dict]:
    """Each projection quantized alone: its mean and p99 KL and top-1 agreement, most sensitive first
    (`index` keeps the model order)."""
    rows = []
    for index, name in enumerate(n for n in quantizable_modules(model, LM_HEAD in weights) if n in weights):
        with swapped(model, {name: weights[name]}):
            c, _ = compare(windows, base, [runner.logprobs(w) for w in windows])
        rows.append({"module": name, "index": index, "kl_mean": c.kl_mean, "kl_p99": c.kl_p99,
                     "top1_agreement": c.top1_agreement})
    return sorted(rows, key=lambda r: -r["kl_mean"])


def evaluate(model: str | None, fmt: QuantFormat | None, kv_cache_dtype: str = "auto", num_tokens: int = 1024,
             window: int = 256, per_layer: bool = False, skip_top: int = 0, calibration: str = "auto",
             calibration_tokens: int = 4096, device: str = "auto", dtype: str = "auto",
             load_format: str = "auto", quantize_lm_head: bool = False, save_dir: str | None = None) -> dict:
    """Base vs quantized (weights `fmt`, None for none, quantized as `tokenmill quantize` would; KV
    `kv_cache_dtype`) over the corpus; with per_layer or skip_top, the sensitivity ranking and the mixed plan
    keeping the skip_top worst projections in 16-bit; quantize_lm_head: the LM head is quantized (and ranked) too.
    The fp8 KV pass folds scales into the model: it is last. save_dir: the evaluated weights are also written
    there as a `tokenmill quantize` folder (so that --replay runs the very weights scored)."""
    from tokenmill.engine.llm_engine import pick_device, pick_dtype
    from tokenmill.model.loader import load_model, load_model_config, resolve_model
    from tokenmill.quant.kv_cache import kv_cache_torch_dtype, prepare_fp8_kv
    from tokenmill.quant.quantize import check_calibration, quantize_weights, resolve_calibration
    from tokenmill.tokenizer import load_tokenizer

    if fmt is None and kv_cache_dtype == "auto":
        raise ValueError("nothing to evaluate: give a weight method, a kv_cache_dtype, or both")
    if (per_layer or skip_top or quantize_lm_head) and fmt is None:
        raise ValueError("per-layer sensitivity, --skip-top and --quantize-lm-head need a weight method")
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens (a token and the one it predicts), got {window}")
    if skip_top < 0:
        raise ValueError(f"skip_top must be >= 0 (projections kept in 16-bit), got {skip_top}")
    if num_tokens < 2:  # a slice by 0 or a negative count would be (nearly) the whole corpus
        raise ValueError(f"num_tokens must be at least 2 (a token and the one it predicts), got {num_tokens}")
    if fmt is not None:
        check_calibration(calibration, fmt, calibration_tokens)
    path = resolve_model(model)
    dev = pick_device(device)
    config = load_model_config(path, load_format)
    longest = min(window, num_tokens)
    if longest > config.max_position_embeddings:  # positions past the model's rotary table
        raise ValueError(f"windows of {longest} tokens exceed the model's {config.max_position_embeddings} "
                         f"positions; use a window of at most {config.max_position_embeddings}")
    dt = pick_dtype(dtype, config.torch_dtype, dev)
    kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, dt)
    tokenizer = load_tokenizer(path)
    windows = corpus_windows(tokenizer.encode(corpus_text(), add_special_tokens=False), num_tokens, window)
    net = load_model(config, path, load_format, dt, dev)
    runner = WindowRunner(net, window, dev, dt)
    base = [runner.logprobs(w) for w in windows]
    weights = {} if fmt is None else quantize_weights(net, fmt, calibration, tokenizer, calibration_tokens,
                                                      lm_head=quantize_lm_head)
    plan = {name: qw.fmt for name, qw in weights.items()}
    result: dict = {"model": path, "method": fmt.name if fmt else "none", "kv_cache_dtype": kv_cache_dtype,
                    "calibration": resolve_calibration(calibration, fmt) if fmt else None, "dtype": str(dt).removeprefix("torch."),
                    "device": str(dev), "windows": len(windows), "window": window,
                    "linear_bytes_16bit": linear_bytes(net, {}, quantize_lm_head),
                    "linear_bytes": linear_bytes(net, plan, quantize_lm_head)}
    if per_layer or skip_top:
        result["per_layer"] = layer_sensitivity(net, runner, windows, base, weights)
    if skip_top:
        keep = [r["module"] for r in result["per_layer"][:skip_top]]
        mixed = {name: qw for name, qw in weights.items() if name not in keep}
        # with the KV cache quantized too, as the all-quantized figure beside it; fp8 folds its scales into the
        # projections, so that pass gets a fresh model and its own copy of the weights
        net_m = load_model(config, path, load_format, dt, dev) if kv_dtype == torch.float8_e4m3fn else net
        mixed_m = copy.deepcopy(mixed) if net_m is not net else mixed
        with swapped(net_m, mixed_m):
            if net_m is not net:
                prepare_fp8_kv(net_m, dev, dt, config.vocab_size)
            mixed_runner = WindowRunner(net_m, window, dev, kv_dtype)
            c, _ = compare(windows, base, [mixed_runner.logprobs(w) for w in windows])
        del net_m, mixed_m
        result["mixed"] = {"skip_top": skip_top, "kept_16bit": keep, **c.to_dict(),
                           "linear_bytes": linear_bytes(net, {n: qw.fmt for n, qw in mixed.items()},
                                                        quantize_lm_head)}
    with swapped(net, weights):
        if save_dir is not None and fmt is not None:  # before the fp8 pass folds its scales into them
            from tokenmill.quant.checkpoint import save_quantized
            out_dtype = parse_dtype(config.torch_dtype or "float16")
            save_quantized(net, config, fmt, [], tokenizer, path, save_dir,
                           torch.float16 if out_dtype == torch.float32 else out_dtype)
        if kv_dtype == torch.float8_e4m3fn:
            result["fp8_kv_scales"] = prepare_fp8_kv(net, dev, dt, config.vocab_size)
        quant_runner = WindowRunner(net, window, dev, kv_dtype)
        c, kl = compare(windows, base, [quant_runner.logprobs(w) for w in windows])
    result.update(c.to_dict())
    result["token_kl"] = kl.tolist()
    return result
