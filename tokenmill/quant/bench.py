"""GPU timings of the quantized-weight matmuls against bf16 F.linear on the same shape: bandwidth for decode
(M <= 16: bytes of packed weight + scales + mins read, the number that decode speed follows) and TFLOP/s for
prefill-sized M, always the tile kernel (FP8: its own dispatch, cuBLAS's FP8 GEMM beyond 16 rows, activation
quantization included). The default shape is Llama-3-8B's down projection (4096 x 14336). In
the engine one row goes to the GEMV instead (kernels/triton_gemv.py, timed on every decode matrix by
`python -m tokenmill.kernels.bench_gemv`).

    python -m tokenmill.quant.bench --out bench_results/quant.json
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton

from tokenmill.kernels.bench_kernels import HBM_BYTES_PER_S, median_ms
from tokenmill.kernels.triton_quant import SKINNY_M, MatmulConfig, pick_config, quant_linear
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
        tile = pick_config(m, n, k, x.device)  # given explicitly: one row would otherwise go to the GEMV
        dispatched = fmt.fp8 and m > SKINNY_M  # FP8's own dispatch: cuBLAS beyond 16 rows
        ms = median_ms(lambda args=args, tile=None if dispatched else tile: quant_linear(*args, tile))
        rows.append(_row(name, n, k, m, ms, moved, flops, bf16_ms, "cuBLAS FP8" if dispatched else describe(tile)))
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
    default = pick_config(m, n, k, args[0].device)
    best: tuple[float, MatmulConfig] = (float("inf"), default)
    int4 = args[1].dtype == torch.uint8
    sms = torch.cuda.get_device_properties(args[0].device).multi_processor_count
    for block_n, block_k, warps, bit in itertools.product((16, 32, 64), (128, 256, 512), (4, 8),
                                                          (False, True) if int4 else (False,)):
        tiles = triton.cdiv(n, block_n) * triton.cdiv(m, default.block_m)
        split = max(1, min(triton.cdiv(2 * sms, tiles), triton.cdiv(k, block_k), 16))
        cfg = MatmulConfig(default.block_m, block_n, block_k, split, warps, num_stages=4, bit_dequant=bit)
        try:
            ms = median_ms(lambda cfg=cfg: quant_linear(*args, cfg))
        except triton.runtime.errors.OutOfResources:
            continue
        if ms < best[0]:
            best = (ms, cfg)
    return best


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
    parser.add_argument("--tune", action="store_true", help="also search tile configs for decode-sized M (<= 16)")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the quant bench needs a CUDA GPU")
    torch.manual_seed(0)
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
