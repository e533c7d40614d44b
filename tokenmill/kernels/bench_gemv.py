"""GPU timings of batch-1 decode matmuls on Llama-3-8B's four projections: cuBLAS (F.linear) beside the Triton
GEMV (triton_gemv.py) in bf16, and the quantized GEMV beside the 16-row tile kernel (triton_quant.py) in INT8,
INT4 g128 and FP8; for INT4 also the tensor-core decode kernel (triton_int4_mma.py), at one row and at
four, and the ceiling: a kernel that only reads the packed bytes, 64 bytes of a row at a time as the INT4
kernels do. Each timed call reads a different copy of the weights, so the figures are HBM speed, as in
decode (where 31 other layers pass through the 50 MB L2 between two uses of a matrix), not L2 speed.

    python -m tokenmill.kernels.bench_gemv --tune --out bench_results/gemv.json
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels import triton_int4_mma
from tokenmill.kernels.bench_kernels import HBM_BYTES_PER_S, median_ms
from tokenmill.kernels.triton_gemv import (
    DENSE,
    DEQUANT_MODES,
    FP8,
    INT4,
    INT8,
    INT8_BITS_CFG,
    WIDE_N,
    GemvConfig,
    default_config,
    dense_gemv,
    quant_gemv,
)
from tokenmill.kernels.triton_quant import pick_config, quant_linear
from tokenmill.quant.formats import QuantFormat, quantize

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}
LAYER = ("qkv", "o", "gate_up", "down")  # a decoder layer's matrices: the tuning objective is their total time
Timings = dict[tuple[int, GemvConfig], dict[str, float]]  # (kind, config) -> matrix -> ms
ROTATE_BYTES = 512 << 20
KINDS = {"bf16": DENSE, "int8": INT8, "int4": INT4, "fp8": FP8}


def _copies(nbytes: int) -> int:
    return max(2, -(-ROTATE_BYTES // nbytes))


def time_rotating(fn: Callable[..., object], args_list: list[tuple]) -> float:
    """ms per call of fn over argument sets used in turn (one CUDA graph holds one call per set)."""
    reps = len(args_list)
    it = iter(itertools.cycle(args_list))
    return median_ms(lambda: fn(*next(it)), reps=reps)


@triton.jit
def _read_kernel(w_ptr, out_ptr, stride_w, k_per_split, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """XOR of [BLOCK_N, WORDS] tiles of 32-bit words along a split of each row: reads and nothing else."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + tl.arange(0, WORDS)[None, :]
    acc = tl.zeros([BLOCK_N, WORDS], tl.int32)
    k_lo = tl.program_id(1) * k_per_split
    for kw in range(k_lo, k_lo + k_per_split, WORDS):
        acc ^= tl.load(ptrs + kw)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(acc))


def read_ceiling(copies: list[torch.Tensor]) -> float:
    """ms to read a packed weight ([N, bytes] with N a multiple of 32 and 64-byte rows) 64 bytes of a row at a
    time, the best of a few grids: what a kernel that does nothing with the bytes reaches."""
    n, nbytes = copies[0].shape
    words = [c.view(torch.int32) for c in copies]
    best = float("inf")
    for split in (1, 2, 4, 8):
        if (nbytes // 4) % (16 * split):
            continue
        out = torch.empty(n // 32 * split, dtype=torch.int32, device=copies[0].device)
        best = min(best, time_rotating(lambda w, split=split, out=out: _read_kernel[(n // 32, split)](
            w, out, nbytes // 4, nbytes // 4 // split, BLOCK_N=32, WORDS=16, num_warps=8), [(w,) for w in words]))
    return best


def grid(kind: int, dequant: str | None = None) -> list[GemvConfig]:
    """Tile shapes to search; dequant: the quantized kinds' dequantization (default: the one their wide matrices
    use; INT8's "unit" grid also holds its "bits" tile, which float32 activations and unaligned rows run)."""
    mode = "cvt" if kind == DENSE else dequant or default_config(kind, WIDE_N).dequant
    if kind == INT4 and mode == "unit":  # BLOCK_K only sets the split's granularity; a thread holds whole chunks
        return [GemvConfig(bn, 128, 0, warps, mode, pps, chunk, ahead)
                for bn, warps, pps, chunk, ahead in itertools.product((64, 128, 256), (4, 8), (1, 2, 4, 8), (8, 16),
                                                                      (1, 2))
                if bn * 64 // (32 * warps) <= 128]
    if kind == INT8 and mode == "unit":  # a per-channel sub-tile is the whole BLOCK_K: 32 to 128 weights a thread
        return [INT8_BITS_CFG] + [GemvConfig(bn, bk, 0, warps, mode, pps, chunk, ahead, early=True)
                for bn, bk, warps, pps, chunk, ahead in itertools.product((16, 32, 64, 128), (128, 256, 512), (4, 8),
                                                                          (2, 4), (16, 32), (1, 2))
                if 32 <= bn * bk // (32 * warps) <= 128]
    cfgs = []
    for bn, bk, warps, pps in itertools.product((4, 8, 16, 32, 64, 128, 256), (128, 256, 512, 1024), (4, 8), (1, 2, 4)):
        acc = bn * (min(bk, 128) // 2 if kind == INT4 else bk) // (32 * warps)  # fp32 accumulators a thread
        if 4 <= acc <= 64:
            cfgs.append(GemvConfig(bn, bk, 0, warps, mode, pps))
    return cfgs


def bench(name: str, n: int, k: int, tune: set[int], dequant: str | None, timings: Timings) -> list[dict]:
    """Rows for one matrix; every grid config's time of a kind in tune goes into timings[(kind, config)][name]."""
    rows = []
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    ws = [w0] + [w0.clone() for _ in range(_copies(w0.numel() * 2) - 1)]
    dense_args = [(x, w) for w in ws]

    def row(kernel: str, ms: float, moved: int, cfg: GemvConfig | None = None) -> None:
        rows.append({"matrix": name, "shape": f"{n}x{k}", "kernel": kernel, "us": ms * 1e3,
                     "pct_of_hbm": 100 * moved / (ms * 1e-3) / HBM_BYTES_PER_S,
                     "config": "" if cfg is None else describe(cfg)})

    moved = w0.numel() * 2
    row("bf16 F.linear", time_rotating(F.linear, dense_args), moved)
    row("bf16 gemv", time_rotating(dense_gemv, dense_args), moved, default_config(DENSE, n, k=k))
    if DENSE in tune:
        ms, cfg = search(lambda x, w, cfg: dense_gemv(x, w, None, cfg), dense_args, grid(DENSE), DENSE, name,
                         timings)
        row("bf16 gemv best", ms, moved, cfg)
    del ws, dense_args
    if name not in LAYER:
        return rows
    for fmt_name, kind in (("int8", INT8), ("int4-g128", INT4), ("fp8", FP8)):
        fmt = QuantFormat.parse(fmt_name)
        qw = quantize(w0, fmt)
        moved = (qw.qweight.numel() + qw.scales.numel() * qw.scales.element_size()
                 + (0 if qw.mins is None else qw.mins.numel() * 2))
        copies = [qw] + [dataclasses.replace(qw, qweight=qw.qweight.clone(), scales=qw.scales.clone(),
                                             mins=None if qw.mins is None else qw.mins.clone())
                         for _ in range(_copies(moved) - 1)]
        qargs = [(x, q.qweight, q.scales, q.mins, k, fmt.group(k), None) for q in copies]
        tile = pick_config(1, n, k, x.device)
        row(f"{fmt_name} tile", time_rotating(lambda *a, tile=tile: quant_linear(*a, tile), qargs), moved)
        row(f"{fmt_name} gemv", time_rotating(quant_gemv, qargs), moved, default_config(kind, n, k=k))
        if kind == FP8:  # what the engine runs at one row: x quantized (one more launch), then the GEMV
            row(f"{fmt_name} linear", time_rotating(quant_linear, qargs), moved)
        if kind == INT4:  # the tensor-core kernel at one row, and against the tile kernel at four
            mma_cfg = (triton_int4_mma.default_config(1, n, k, triton_int4_mma.has_tma(qw.qweight))
                       or triton_int4_mma.MMA_CFG)
            row(f"{fmt_name} mma", time_rotating(
                lambda *a, cfg=mma_cfg: triton_int4_mma.int4_mma_gemv(*a, cfg), qargs), moved)
            x4 = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
            q4 = [(x4, *a[1:]) for a in qargs]
            row(f"{fmt_name} tile, 4 rows", time_rotating(lambda *a: quant_linear(*a, pick_config(4, n, k, x.device)),
                                                          q4), moved)
            row(f"{fmt_name} mma, 4 rows", time_rotating(triton_int4_mma.int4_mma_gemv, q4), moved)
            if n % 32 == 0 and qw.qweight.shape[1] % 64 == 0:
                row(f"{fmt_name} bytes, read only", read_ceiling([q.qweight for q in copies]),
                    qw.qweight.numel())
        if kind in tune:
            ms, cfg = search(quant_gemv, qargs, grid(kind, dequant), kind, name, timings)
            row(f"{fmt_name} gemv best", ms, moved, cfg)
            for mode in (m for m in DEQUANT_MODES if m != cfg.dequant and (kind == INT4 or m != "prmt")):
                alt = dataclasses.replace(cfg, dequant=mode)
                row(f"{fmt_name} gemv best, {mode}",
                    time_rotating(lambda *a, alt=alt: quant_gemv(*a, alt), qargs), moved, alt)
    return rows


def search(fn: Callable[..., object], args_list: list[tuple], cfgs: list[GemvConfig], kind: int, name: str,
           timings: Timings) -> tuple[float, GemvConfig]:
    """The fastest config for one matrix; every time is recorded in timings."""
    result = (float("inf"), cfgs[0])
    for cfg in cfgs:
        try:
            ms = time_rotating(lambda *a, cfg=cfg: fn(*a, cfg), args_list)
        except triton.runtime.errors.OutOfResources:  # too many registers or too much shared memory
            continue
        timings.setdefault((kind, cfg), {})[name] = ms
        result = min(result, (ms, cfg), key=lambda r: r[0])
    return result


def best_overall(timings: Timings, kind: int) -> tuple[float, GemvConfig] | None:
    """The config with the least total time over a decoder layer's four matrices (the per-matrix "best" rows
    show where a per-shape default pays, as INT4's WIDE_N tile does)."""
    totals = [(sum(t[m] for m in LAYER), cfg) for (kd, cfg), t in timings.items()
              if kd == kind and set(LAYER) <= set(t)]
    return min(totals, key=lambda r: r[0]) if totals else None


def describe(cfg: GemvConfig) -> str:
    return (f"n{cfg.block_n} k{cfg.block_k} warps {cfg.num_warps} "
            + (f"split {cfg.split_k}" if cfg.split_k else f"{cfg.programs_per_sm}/SM")
            + f" {cfg.dequant}" + (f" chunk {cfg.chunk} ahead {cfg.ahead}" if cfg.dequant == "unit" else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", nargs="*", choices=list(KINDS), metavar="KIND",
                        help="also search the GEMV tile grid of these kinds (none named: all of them)")
    parser.add_argument("--dequant", choices=DEQUANT_MODES[1:],
                        help="the quantized kinds' dequantization in the search (default: their committed one)")
    parser.add_argument("--matrices", nargs="+", default=list(LLAMA3_8B), choices=list(LLAMA3_8B))
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the GEMV bench needs a CUDA GPU")
    torch.manual_seed(0)
    timings: Timings = {}
    tune = set() if args.tune is None else {KINDS[k] for k in args.tune or KINDS}
    rows = [r for name in args.matrices for r in bench(name, *LLAMA3_8B[name], tune, args.dequant, timings)]
    print(f"{'matrix':<8} {'shape':<11} {'kernel':<24} {'us':>7} {'%HBM':>5}  config")
    for r in rows:
        print(f"{r['matrix']:<8} {r['shape']:<11} {r['kernel']:<24} {r['us']:>7.1f} {r['pct_of_hbm']:>5.0f}  "
              f"{r['config']}")
    overall = []
    for kind, label in ((DENSE, "bf16"), (INT8, "int8"), (INT4, "int4-g128"), (FP8, "fp8")):
        found = best_overall(timings, kind)
        if found:
            total, cfg = found
            per = timings[(kind, cfg)]
            overall.append({"kernel": label, "config": describe(cfg), "layer_us": total * 1e3,
                            "per_matrix_us": {m: per[m] * 1e3 for m in LAYER}})
            print(f"best for a whole layer, {label}: {describe(cfg)}: {total * 1e3:.1f} us "
                  + " ".join(f"{m} {per[m] * 1e3:.1f}" for m in LAYER))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "best_for_layer": overall}, f, indent=1)


if __name__ == "__main__":
    main()
