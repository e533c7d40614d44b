"""GPU timings of the quantized-weight matmuls against bf16 F.linear on the same shape: bandwidth for decode
(M <= 16: bytes of packed weight + scales + mins read, the number that decode speed follows) and TFLOP/s for
prefill-sized M. The default shape is Llama-3-8B's down projection (4096 x 14336).

    python -m tokenmill.quant.bench --out bench_results/quant.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from tokenmill.kernels.bench_kernels import HBM_BYTES_PER_S, median_ms
from tokenmill.kernels.triton_quant import pick_config, quant_linear
from tokenmill.quant.formats import QuantFormat, quantize

FORMATS = ("int4-g128", "int4-g32", "int8")


def bench_shape(n: int, k: int, m: int, formats: tuple[str, ...] = FORMATS) -> list[dict]:
    """One row per format plus the bf16 baseline, for x [m, k] @ W[n, k].T."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * n * k
    bf16_ms = median_ms(lambda: F.linear(x, w))
    rows = [_row("bf16 F.linear", n, k, m, bf16_ms, w.numel() * 2 + x.numel() * 2 + m * n * 2, flops, bf16_ms)]
    for name in formats:
        fmt = QuantFormat.parse(name)
        qw = quantize(w, fmt)
        moved = (qw.qweight.numel() + qw.scales.numel() * 2 + (0 if qw.mins is None else qw.mins.numel() * 2)
                 + x.numel() * 2 + m * n * 2)
        args = (x, qw.qweight, qw.scales, qw.mins, k, fmt.group(k), None)
        ms = median_ms(lambda args=args: quant_linear(*args))
        rows.append(_row(name, n, k, m, ms, moved, flops, bf16_ms))
        if m == 1:  # the tensor-core tile path the one-row kernel replaced, measured beside it
            tiled = pick_config(m, n, k, x.device)
            ms = median_ms(lambda args=args: quant_linear(*args, tiled))
            rows.append(_row(f"{name} (16-row tile)", n, k, m, ms, moved, flops, bf16_ms))
    return rows


def _row(kernel: str, n: int, k: int, m: int, ms: float, moved: int, flops: int, bf16_ms: float) -> dict:
    return {"kernel": kernel, "shape": f"M={m} N={n} K={k}", "us": ms * 1e3, "GB/s": moved / ms / 1e6,
            "pct_of_hbm": 100 * moved / (ms * 1e-3) / HBM_BYTES_PER_S, "TFLOP/s": flops / ms / 1e9,
            "speedup_vs_bf16": bf16_ms / ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="output features (default: %(default)s)")
    parser.add_argument("--k", type=int, default=14336, help="input features (default: %(default)s)")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 2048], help="rows of x to time")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the quant bench needs a CUDA GPU")
    torch.manual_seed(0)
    rows = [r for m in args.m for r in bench_shape(args.n, args.k, m)]
    print(f"{'kernel':<16} {'shape':<26} {'us':>9} {'GB/s':>8} {'%HBM':>6} {'TFLOP/s':>8} {'x bf16':>7}")
    for r in rows:
        print(f"{r['kernel']:<16} {r['shape']:<26} {r['us']:>9.1f} {r['GB/s']:>8.0f} {r['pct_of_hbm']:>6.0f} "
              f"{r['TFLOP/s']:>8.1f} {r['speedup_vs_bf16']:>7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
