"""GPU timings of the quantized-weight matmuls against bf16 F.linear on the same shape: bandwidth for decode
(M <= 16: bytes of packed weight + scales + mins read, the number that decode speed follows) and TFLOP/s for
prefill-sized M, always the tile kernel (FP8: its own dispatch beyond 16 rows, e4m3 tiles or cuBLAS's FP8 GEMM,
activation quantization included). The default shape is Llama-3-8B's down projection (4096 x 14336). In
the engine one row goes to the GEMV instead (kernels/triton_gemv.py, timed on every decode matrix by
`python -m tokenmill.kernels.bench_gemv`).

    python -m tokenmill.quant.bench --out bench_results/quant.json

`--fp8-gemm` times FP8 at 16 to 1,024 rows on Llama-3-8B's four decode matrices instead: the tile kernel's e4m3
dots (its FP8_GEMM config and, with --tune, the best of a grid) and, up to triton_fp8_skinny.MAX_ROWS rows, the
swapped-operand decode kernel, against cuBLAS's rowwise FP8 GEMM (with and without
fast accumulation) and bf16, weights rotated through more copies than L2 holds: the timings that
triton_fp8_linear.use_scaled_mm's choice between the two rests on.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch
import torch.nn.functional as F
import triton

from tokenmill.kernels import triton_fp8_linear, triton_fp8_skinny
from tokenmill.kernels.bench_gemv import LAYER, LLAMA3_8B, time_rotating
from tokenmill.kernels.bench_kernels import HBM_BYTES_PER_S, median_ms
from tokenmill.kernels.triton_quant import SKINNY_M, MatmulConfig, pick_config, quant_linear, with_split
from tokenmill.quant.formats import QuantFormat, quantize

FORMATS = ("int4-g128", "int4-g32", "int8", "fp8")


def bench_shape(n: int, k: int, m: int, formats: tuple[str, ...] = FORMATS, tune: bool = False) -> list[dict]:
    """One row per format plus the bf16 baseline, for x [m, k] @ W[n, k].T; with tune, also the best tile
    config found for each format."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * n * k
    bf16_ms = median_ms(lambda: F.linear(x, w))
    rows = [_row("bf16 F.linear", n, k, m, bf16_ms, w.numel() * 2 + x.numel() * 2 + m * n * 2, flops, bf16_ms)]
    for name in formats:
        fmt = QuantFormat.parse(name)
        qw = quantize(w, fmt)
        moved = (qw.qweight.numel() + qw.scales.numel() * qw.scales.element_size()
                 + (0 if qw.mins is None else qw.mins.numel() * 2) + x.numel() * 2 + m * n * 2)
        args = (x, qw.qweight, qw.scales, qw.mins, k, fmt.group(k), None)
        tile = pick_config(m, n, k, x.device, int4=fmt.bits == 4)  # given: one row would otherwise take the GEMV
        skinny = fmt.fp8 and triton_fp8_skinny.takes(m, n, k, x.dtype)
        dispatched = fmt.fp8 and (m > SKINNY_M or skinny)  # FP8's own dispatch: its decode kernel, tiles, cuBLAS
        ms = median_ms(lambda args=args, tile=None if dispatched else tile: quant_linear(*args, tile))
        label = describe(pick_config(m, n, k, x.device, fmt.fp8) if dispatched else tile)
        if skinny:
            label = describe_skinny(triton_fp8_skinny.default_config(n))
        elif dispatched and triton_fp8_linear.use_scaled_mm(m, n, k, x.dtype):
            label = "cuBLAS FP8"
        rows.append(_row(name, n, k, m, ms, moved, flops, bf16_ms, label))
        if tune:
            best_ms, best = best_config(args, m, n, k)
            rows.append(_row(f"{name} best", n, k, m, best_ms, moved, flops, bf16_ms, describe(best)))
    return rows


def describe(cfg: MatmulConfig) -> str:
    return (f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} split {cfg.split_k} warps {cfg.num_warps} "
            f"stages {cfg.num_stages}" + (" bit-dequant" if cfg.bit_dequant else ""))


def best_config(args: tuple, m: int, n: int, k: int) -> tuple[float, MatmulConfig]:
    """The fastest of a grid of decode tile shapes (split as pick_config would) for these arguments: what the
    defaults should become."""
    int4 = args[1].dtype == torch.uint8
    default = pick_config(m, n, k, args[0].device, int4=int4)
    best: tuple[float, MatmulConfig] = (float("inf"), default)
    for block_n, block_k, warps, bit in itertools.product((16, 32, 64), (128, 256, 512), (4, 8),
                                                          (False, True) if int4 else (False,)):
        cfg = with_split(MatmulConfig(default.block_m, block_n, block_k, num_warps=warps, num_stages=4,
                                      bit_dequant=bit), m, n, k, args[0].device)
        try:
            ms = median_ms(lambda cfg=cfg: quant_linear(*args, cfg))
        except triton.runtime.errors.OutOfResources:
            continue
        if ms < best[0]:
            best = (ms, cfg)
    return best


def describe_skinny(cfg: triton_fp8_skinny.SkinnyConfig) -> str:
    return (f"swapped n{cfg.block_n} k{cfg.block_k} {cfg.programs_per_sm} a multiprocessor warps {cfg.num_warps} "
            f"stages {cfg.num_stages}")


FP8_GEMM_ROWS = (16, 17, 32, 64, 128, 256, 512, 1024)
L2_BYTES = 64 << 20  # more than the H200's 50 MB of L2: rotating through this many bytes of weights misses it


def bench_fp8_gemm(n: int, k: int, rows: tuple[int, ...] = FP8_GEMM_ROWS, tune: bool = False) -> list[dict]:
    """FP8 beyond 16 rows of bf16 output for one matrix: the tile kernel's e4m3 dots against cuBLAS, activation
    quantization included in both, and bf16 F.linear, each over weight copies that together miss L2."""
    fp8 = QuantFormat.parse("fp8")
    copies = max(2, -(-L2_BYTES // (n * k)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(min(copies, 4))]
    reps = -(-copies // len(weights))
    quantized = [quantize(w, fp8) for w in weights] * reps
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        sets = [(x, qw.qweight, qw.scales, None, k, k, None) for qw in quantized]
        flops, moved = 2 * m * n * k, n * k + n * 4 + m * k * 2 + m * n * 2
        bf16_ms = time_rotating(lambda w: F.linear(x, w), [(w,) for w in weights * reps])
        found = [_row("bf16 F.linear", n, k, m, bf16_ms, moved + n * k, flops, bf16_ms)]
        for fast in (False, True):
            ms = time_rotating(lambda *a, fast=fast: _cublas_fp8(*a, fast=fast), sets)
            found.append(_row("cuBLAS FP8" + (" fast" if fast else ""), n, k, m, ms, moved, flops, bf16_ms))
        default = pick_config(m, n, k, x.device, fp8=True)
        ms = time_rotating(lambda *a: quant_linear(*a, default), sets)
        found.append(_row("tile e4m3", n, k, m, ms, moved, flops, bf16_ms, describe(default)))
        if triton_fp8_skinny.takes(m, n, k, torch.bfloat16):
            ms = time_rotating(_skinny_fp8, sets)
            found.append(_row("swapped e4m3", n, k, m, ms, moved, flops, bf16_ms,
                              describe_skinny(triton_fp8_skinny.default_config(n))))
        if tune:
            best_ms, best = best_fp8_config(sets, m, n, k)
            found.append(_row("tile e4m3 best", n, k, m, best_ms, moved, flops, bf16_ms, describe(best)))
        out += found
    return out


def _cublas_fp8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, *_: object,
                fast: bool = False) -> torch.Tensor:
    xq, x_scales = triton_fp8_linear.quantize_rows(x)
    return triton_fp8_linear.scaled_mm(xq, x_scales, qweight, scales, None, fast_accum=fast)


def _skinny_fp8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, *_: object) -> torch.Tensor:
    xq, x_scales = triton_fp8_linear.quantize_rows(x)
    return triton_fp8_skinny.skinny_mm(xq, x_scales, qweight, scales, None, None, torch.bfloat16)


def best_fp8_config(sets: list[tuple], m: int, n: int, k: int) -> tuple[float, MatmulConfig]:
    """The fastest e4m3 tile config for m rows (split as pick_config would), then the same with fast
    accumulation."""
    device = sets[0][0].device
    best: tuple[float, MatmulConfig] = (float("inf"), pick_config(m, n, k, device, fp8=True))
    grid = [(bk, st) for bk in (128, 256) for st in ((3, 4) if bk == 128 else (3,))]
    for block_m, block_n, (block_k, stages), warps in itertools.product((64,) if m <= 64 else (64, 128),
                                                                        (64, 128, 256), grid, (4, 8)):
        cfg = with_split(MatmulConfig(block_m, block_n, block_k, num_warps=warps, num_stages=stages), m, n, k, device)
        best = min(best, (_time_config(sets, cfg), cfg), key=lambda t: t[0])
    fast = dataclasses.replace(best[1], fast_accum=True)
    return min(best, (_time_config(sets, fast), fast), key=lambda t: t[0])


def _time_config(sets: list[tuple], cfg: MatmulConfig) -> float:
    try:
        return time_rotating(lambda *a: quant_linear(*a, cfg), sets)
    except triton.runtime.errors.OutOfResources:
        return float("inf")


def _row(kernel: str, n: int, k: int, m: int, ms: float, moved: int, flops: int, bf16_ms: float,
         config: str = "") -> dict:
    return {"kernel": kernel, "shape": f"M={m} N={n} K={k}", "config": config, "us": ms * 1e3, "GB/s": moved / ms / 1e6,
            "pct_of_hbm": 100 * moved / (ms * 1e-3) / HBM_BYTES_PER_S, "TFLOP/s": flops / ms / 1e9,
            "speedup_vs_bf16": bf16_ms / ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="output features (default: %(default)s)")
    parser.add_argument("--k", type=int, default=14336, help="input features (default: %(default)s)")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 2048], help="rows of x to time")
    parser.add_argument("--tune", action="store_true", help="also search tile configs for decode-sized M (<= 16); "
                        "with --fp8-gemm, for FP8 at each row count")
    parser.add_argument("--fp8-gemm", action="store_true", help="FP8 at 17-1,024 rows on Llama-3-8B's decode matrices")
    parser.add_argument("--fp8-rows", type=int, nargs="+", default=list(FP8_GEMM_ROWS),
                        help="rows --fp8-gemm times (default: %(default)s)")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the quant bench needs a CUDA GPU")
    torch.manual_seed(0)
    if args.fp8_gemm:
        rows = [r for name in LAYER for r in bench_fp8_gemm(*LLAMA3_8B[name], tuple(args.fp8_rows), args.tune)]
    else:
        rows = [r for m in args.m for r in bench_shape(args.n, args.k, m, tune=args.tune and m <= SKINNY_M)]
    print(f"{'kernel':<16} {'shape':<24} {'us':>8} {'GB/s':>7} {'%HBM':>5} {'TFLOP/s':>8} {'x bf16':>7}  config")
    for r in rows:
        print(f"{r['kernel']:<16} {r['shape']:<24} {r['us']:>8.1f} {r['GB/s']:>7.0f} {r['pct_of_hbm']:>5.0f} "
              f"{r['TFLOP/s']:>8.1f} {r['speedup_vs_bf16']:>7.2f}  {r['config']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
