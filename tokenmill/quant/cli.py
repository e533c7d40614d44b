"""`tokenmill quantize` and `tokenmill quant-eval`: option parsing only; the work is in the quant package."""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from tokenmill.engine.arg_utils import check_at_least
from tokenmill.quant.formats import GROUP_SIZES, QuantFormat
from tokenmill.quant.kv_cache import KV_CACHE_DTYPES
from tokenmill.quant.quantize import CALIBRATIONS, check_can_create


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: the bundled SmolLM2 GGUF)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf"],  # not dummy: no weights
                   help="auto | safetensors | gguf (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=None, choices=GROUP_SIZES,
                   help="inputs per scale: int4 default 128; int8 default one scale per output channel (fp8: always)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    p.add_argument("--calibration", default="auto", choices=CALIBRATIONS,
                   help="gptq: calibrated on pydoc_data (slow, best); rtn: plain rounding; auto: gptq for int4, "
                        "rtn for int8 and fp8 (default: %(default)s)")
    p.add_argument("--calibration-tokens", type=int, default=4096, help="GPTQ calibration tokens (default: %(default)s)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize the LM head too (a tied one as a quantized copy of the embedding)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    q = subparsers.add_parser("quantize", help="write a weight-quantized copy of a model (loadable folder)")
    _common(q)
    q.add_argument("--method", required=True, choices=("int8", "int4", "fp8"),
                   help="weight format (fp8: e4m3 weights, activations quantized per token at run time)")
    q.add_argument("--out", required=True, help="output folder")
    q.add_argument("--skip", action="append", default=[], metavar="MODULE",
                   help="keep this projection in 16-bit, e.g. model.layers.0.mlp.down_proj (repeatable)")
    q.add_argument("--dtype", default="auto",
                   help="dtype of unquantized tensors: auto (the checkpoint's, float16 for GGUF) | bfloat16 | float16")
    q.set_defaults(func=cmd_quantize)

    e = subparsers.add_parser("quant-eval", help="KL / top-1 / perplexity of a quantized model vs the original")
    _common(e)
    e.add_argument("--method", default="int8", help="int8 | int4 | fp8 | none (KV cache only) (default: %(default)s)")
    e.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="KV cache of the quantized run")
    e.add_argument("--dtype", default="auto", help="compute dtype (default: float32 on CPU, bf16 on CUDA)")
    e.add_argument("--num-tokens", type=int, default=1024, help="corpus tokens (default: %(default)s)")
    e.add_argument("--window", type=int, default=256, help="tokens per evaluated sequence (default: %(default)s)")
    e.add_argument("--per-layer", action="store_true", help="rank projections by the KL each causes alone")
    e.add_argument("--skip-top", type=int, default=0, metavar="K",
                   help="also evaluate keeping the K most sensitive projections in 16-bit")
    e.add_argument("--replay", metavar="PROMPTS_JSONL", help="replay these prompts through both models")
    e.add_argument("--max-tokens", type=int, default=128, help="replay: tokens per answer (default: %(default)s)")
    e.add_argument("--json", metavar="PATH", help="write the full result as JSON ('-' for stdout)")
    e.add_argument("--plot", metavar="PNG", help="save a KL histogram (and sensitivity chart) here")
    e.set_defaults(func=cmd_quant_eval)


def cmd_quantize(ns: argparse.Namespace) -> None:
    from tokenmill.quant.quantize import quantize_checkpoint
    fmt = QuantFormat.parse(ns.method, ns.group_size)
    out = quantize_checkpoint(ns.model, fmt, ns.out, ns.skip, ns.calibration, ns.calibration_tokens, ns.dtype,
                              ns.device, ns.load_format, ns.quantize_lm_head)
    print(f"wrote {fmt.name} model to {out}")


def check_output_files(ns: argparse.Namespace) -> None:
    """--json and --plot are written after the evaluation, minutes later: a path that cannot be is refused before
    it starts (a missing folder is made when written)."""
    for flag, path in (("--json", ns.json), ("--plot", ns.plot)):
        if path and path != "-":
            if os.path.isdir(path):
                raise ValueError(f"{flag} {path} is a directory; give a file path")
            check_can_create(os.path.dirname(path) or ".", f"{flag} folder")


def in_folder(path: str) -> str:
    """path, its folder made if missing."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return path


def cmd_quant_eval(ns: argparse.Namespace) -> None:
    from tokenmill.quant.eval import evaluate
    from tokenmill.quant.report import format_report, save_plot
    check_output_files(ns)
    check_at_least(ns, {"max_tokens": 1})
    fmt = None if ns.method == "none" else QuantFormat.parse(ns.method, ns.group_size)
    prompts = None
    if ns.replay:  # read before the evaluation, so a bad line costs no minutes of it
        from tokenmill.quant.replay import load_prompts
        prompts = load_prompts(ns.replay)
    with tempfile.TemporaryDirectory(prefix="tokenmill-quant-eval-") as saved:
        # --replay runs the very weights scored (GPTQ's, not a rounding at load): evaluate writes them here
        save = saved if prompts is not None and fmt is not None else None
        result = evaluate(ns.model, fmt, ns.kv_cache_dtype, ns.num_tokens, ns.window, ns.per_layer, ns.skip_top,
                          ns.calibration, ns.calibration_tokens, ns.device, ns.dtype, ns.load_format,
                          ns.quantize_lm_head, save_dir=save)
        if prompts is not None:
            from tokenmill.quant.replay import replay
            base = {"model": ns.model, "device": ns.device, "dtype": ns.dtype, "load_format": ns.load_format}
            quant = {**base, "kv_cache_dtype": ns.kv_cache_dtype}
            if save is not None:
                quant.update(model=save, load_format="auto")
            result["replay"] = replay(prompts, base, quant, ns.max_tokens)
    if ns.plot:
        save_plot(result, in_folder(ns.plot))
    token_kl = result.pop("token_kl")
    if ns.json == "-":
        print(json.dumps(result, indent=1))
        return
    print(format_report(result))
    if ns.json:
        with open(in_folder(ns.json), "w", encoding="utf-8") as f:
            json.dump({**result, "token_kl": token_kl}, f, indent=1)
