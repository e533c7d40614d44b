"""What every offline benchmark shares: building and releasing engines, running prompts to completion, timing that
waits for the GPU, the bytes a decode step reads, the machine description, and the table + JSON output."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import subprocess
import tempfile
import time
from datetime import datetime
from typing import Any, Callable, Iterator, Sequence

import torch

from tokenmill.config import EngineArgs
from tokenmill.engine.arg_utils import add_engine_args
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.kernels import KERNELS_ENV
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

Prompt = list[int]
Column = tuple[str, str]  # (result key, table header)


# ---- engines ------------------------------------------------------------------------------------
@contextlib.contextmanager
def kernel_backend(backend: str) -> Iterator[None]:
    """Kernels are picked when layers are built, so the backend only has to be set while the engine is built."""
    previous = os.environ.get(KERNELS_ENV)
    os.environ[KERNELS_ENV] = backend
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(KERNELS_ENV)
        else:
            os.environ[KERNELS_ENV] = previous


def build_engine(args: EngineArgs, kernels: str = "auto") -> LLMEngine:
    with kernel_backend(kernels):
        return LLMEngine(args)


def release_memory() -> None:
    """Call after dropping the last reference to an engine: on CUDA the next engine sizes its KV pool from what is
    free, so the previous one's weights, KV pool and graph pool must really be gone."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def generate(engine: LLMEngine, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
             on_step: Callable[[LLMEngine], None] | None = None) -> list[RequestOutput]:
    """Add every prompt at once and step until all are finished (continuous batching); outputs in prompt order.
    on_step sees the engine after every step (engine.last_step)."""
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = [engine.add_request(None, p, dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY))
           for p, sp in zip(prompts, params)]
    done: dict[str, RequestOutput] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if on_step is not None:
            on_step(engine)
    return [done[i] for i in ids]


def num_output_tokens(outputs: Sequence[RequestOutput]) -> int:
    return sum(len(c.token_ids) for o in outputs for c in o.outputs)


def warm_up(engine: LLMEngine, prompts: Sequence[Prompt] = ()) -> None:
    """One short request, then prompts (a sample of the workload) for a few tokens each, so kernel compilation
    and allocator growth stay out of the timings: Triton compiles a prefill kernel for each query-tile size it
    meets, a second or more each, and the first configuration of a sweep would pay for it."""
    generate(engine, [list(range(1, 9))], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    if prompts:
        generate(engine, list(prompts), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


# ---- timing -------------------------------------------------------------------------------------
def clock(device: torch.device) -> float:
    """perf_counter after the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


# ---- model facts --------------------------------------------------------------------------------
def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of all weights, bytes one decode token reads): every weight once (with a quantized weight's scales),
    except an embedding table not shared with the LM head, of which a token reads one row."""
    scales = [b for name, b in model.named_buffers() if name.rpartition(".")[2].startswith("weight")]
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *scales])
    head_weights = {id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead)}
    read = total
    for m in model.modules():
        if isinstance(m, VocabParallelEmbedding) and id(m.weight) not in head_weights:
            read -= (m.weight.shape[0] - 1) * m.weight.shape[1] * m.weight.element_size()
    return total, read


def environment(device: torch.device) -> dict[str, Any]:
    """Date, commit and hardware: a figure counts only with these written beside it."""
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__), timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {"date": datetime.now().isoformat(timespec="seconds"), "commit": commit, "device": str(device),
            "hardware": hardware, "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# ---- command line and output --------------------------------------------------------------------
def add_common_args(p: argparse.ArgumentParser) -> None:
    """Engine options (all of EngineArgs) plus --out."""
    p.add_argument("--out", default=None, metavar="PATH", type=writable_path,
                   help="write the results as JSON to PATH")
    add_engine_args(p)


def writable_path(path: str) -> str:
    """The type of --out: the JSON is written after a run that can take minutes, so a path that cannot be written
    (a folder, a place without write access) is refused before the run starts, not after it."""
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a directory; give a file path")
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def result_header(name: str, args: EngineArgs, device: torch.device, params: dict[str, Any]) -> dict[str, Any]:
    return {"benchmark": name, "env": environment(device), "engine_args": dataclasses.asdict(args), "params": params}


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column], title: str | None = None) -> None:
    """Numbers right-aligned, text left-aligned; None shows as '-'."""
    cells = [[_fmt(r.get(key)) for key, _ in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h) in enumerate(columns)]
    text = [any(isinstance(r.get(key), str) for r in rows) for key, _ in columns]
    if title:
        print(title)
    for line in [[h for _, h in columns], ["-" * w for w in widths], *cells]:
        print("  ".join(v.ljust(w) if t else v.rjust(w) for v, w, t in zip(line, widths, text)).rstrip())


def save_json(result: dict[str, Any], path: str | None) -> None:
    if not path:
        return
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"results written to {path}")
