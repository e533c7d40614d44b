"""Offline quantization: round every projection (GPTQ-calibrated or plain), then write a loadable folder.
quant-eval quantizes through quantize_weights too, so what it measures is what `tokenmill quantize` ships."""
from __future__ import annotations

import os
import tempfile

import torch
from torch import nn

from tokenmill.config import parse_dtype
from tokenmill.quant.checkpoint import save_quantized
from tokenmill.quant.formats import QuantFormat, QuantizedWeight, quantize
from tokenmill.quant.linear import QuantLinear, to_quant_linear
from tokenmill.quant.loading import LM_HEAD, linear_modules, quantizable_modules, replace_module
from tokenmill.tokenizer import Tokenizer

CALIBRATIONS = ("auto", "gptq", "rtn")
CALIBRATION_WINDOW = 256


def resolve_calibration(calibration: str, fmt: QuantFormat) -> str:
    """'auto' is GPTQ for INT4 (plain rounding loses too much at 4 bits) and round-to-nearest for INT8 and FP8
    (GPTQ's error feedback is written for integer grids)."""
    if calibration not in CALIBRATIONS:
        raise ValueError(f"calibration {calibration!r} is not supported; allowed: {', '.join(CALIBRATIONS)}")
    if fmt.fp8 and calibration == "gptq":
        raise ValueError("calibration 'gptq' is for int8 / int4; fp8 weights are rounded to nearest ('rtn')")
    return ("gptq" if fmt.bits == 4 else "rtn") if calibration == "auto" else calibration


def check_calibration(calibration: str, fmt: QuantFormat, calibration_tokens: int) -> str:
    """resolve_calibration, and GPTQ's corpus size; quantize and quant-eval call it before a model loads."""
    resolved = resolve_calibration(calibration, fmt)
    if resolved == "gptq" and calibration_tokens < 2:  # a slice by 0 or below would be (nearly) the whole corpus
        raise ValueError(f"calibration_tokens must be at least 2 for GPTQ, got {calibration_tokens}")
    return resolved


def quantize_weights(model: nn.Module, fmt: QuantFormat, calibration: str, tokenizer: Tokenizer,
                     calibration_tokens: int = 4096, skip: list[str] | tuple[str, ...] = (), lm_head: bool = False
                     ) -> dict[str, QuantizedWeight]:
    """Every projection of a float model but `skip` (and the LM head with lm_head), quantized: 'rtn' rounds each
    weight on its own (min/scale fitted per group); 'gptq' also uses the layer inputs on the calibration corpus
    (slower, far better INT4)."""
    names = [name for name in quantizable_modules(model, lm_head) if name not in skip]
    packed = next((n for n in names if isinstance(model.get_submodule(n), QuantLinear)), None)
    if packed is not None:
        raise ValueError(f"{packed} is already quantized ({model.get_submodule(packed).weight.dtype}): quantize the "
                         "original float model, not a quantized one")
    if check_calibration(calibration, fmt, calibration_tokens) == "rtn":
        return {name: quantize(model.get_submodule(name).weight.data, fmt) for name in names}
    from tokenmill.quant.corpus import WindowRunner, calibration_windows
    from tokenmill.quant.gptq import collect_hessians, gptq_quantize
    windows = calibration_windows(tokenizer, calibration_tokens, CALIBRATION_WINDOW)
    param = next(model.parameters())
    runner = WindowRunner(model, CALIBRATION_WINDOW, param.device, param.dtype)
    hessians = collect_hessians(model, runner.logprobs, windows, names)
    return {name: gptq_quantize(model.get_submodule(name).weight.data, hessians.pop(name), fmt) for name in names}


def apply_weights(model: nn.Module, weights: dict[str, QuantizedWeight]) -> None:
    """Replace the projections (and the LM head) for good by QuantLinears holding `weights`."""
    for name, module in quantizable_modules(model, LM_HEAD in weights).items():
        if name in weights:
            replace_module(model, name, to_quant_linear(module, weights[name].fmt, weights[name]))


def check_can_create(folder: str, what: str) -> None:
    """Refuse, before any work, a folder that cannot be created (with its parents) or written: the nearest
    existing folder on its path must take a new file. Tried, not asked of os.access: root passes that for /proc."""
    existing = os.path.abspath(folder)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{what} {folder} cannot be created: {existing} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ValueError(f"{what} {folder} cannot be written: creating a file in {existing} failed "
                         f"({e.strerror or e})") from None


def check_out_dir(out_dir: str) -> None:
    """Refuse, before any work, an output that is a file or a folder with something in it: the checkpoint would be
    written over what is there (with --out the model's own folder, over the original, which then fails halfway)
    or mixed with stale files; or one that cannot be created or written, found out after minutes of quantizing."""
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        what = f"output folder {out_dir} is not empty" if os.path.isdir(out_dir) else f"output {out_dir} is a file"
        raise ValueError(f"{what}; give a new or empty folder (nothing is written over existing files)")
    check_can_create(out_dir, "output folder")


def quantize_checkpoint(model: str | None, fmt: QuantFormat, out_dir: str, skip: list[str] | None = None,
                        calibration: str = "auto", calibration_tokens: int = 4096, dtype: str = "auto",
                        device: str = "auto", load_format: str = "auto", quantize_lm_head: bool = False) -> str:
    """Quantize every projection but `skip` (and the LM head with quantize_lm_head: a tied one becomes a
    quantized copy of the embedding) to `fmt` and save; unquantized tensors are written in `dtype`
    ("auto": the checkpoint's 16-bit dtype, float16 when it names none, as for GGUF files)."""
    from tokenmill.engine.llm_engine import pick_device
    from tokenmill.model.loader import load_model, load_model_config, resolve_model
    from tokenmill.tokenizer import load_tokenizer

    path = resolve_model(model)
    check_out_dir(out_dir)
    check_calibration(calibration, fmt, calibration_tokens)
    dev = pick_device(device)
    config = load_model_config(path, load_format)
    out_dtype = parse_dtype(config.torch_dtype or "float16") if dtype == "auto" else parse_dtype(dtype)
    if out_dtype == torch.float32:
        out_dtype = torch.float16
    net = load_model(config, path, load_format, torch.float32 if dev.type == "cpu" else out_dtype, dev)
    skip = list(skip or [])
    unknown = sorted(set(skip) - set(linear_modules(net)))
    if unknown:
        raise ValueError(f"--skip names no projection of this model: {unknown[:3]}; projections look like "
                         f"{next(iter(linear_modules(net)))}")
    tokenizer = load_tokenizer(path)
    apply_weights(net, quantize_weights(net, fmt, calibration, tokenizer, calibration_tokens, skip, quantize_lm_head))
    save_quantized(net, config, fmt, skip, tokenizer, path, out_dir, out_dtype)
    return out_dir
