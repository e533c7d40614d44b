"""quant-eval output: a text table for people, JSON for scripts, a PNG on request."""
from __future__ import annotations

import os
from typing import Any


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_report(r: dict[str, Any], top: int = 10) -> str:
    """The human-readable summary of an evaluate() (+ replay) result."""
    lines = []

    def row(key: str, value: str) -> None:
        lines.append(f"{key:<18} {value}")

    row("model", os.path.basename(r["model"].rstrip("/")))
    calibration = f" ({r['calibration']})" if r.get("calibration") else ""
    row("quantization", f"weights {r['method']}{calibration}, KV cache {r['kv_cache_dtype']} "
                        f"(compute {r['dtype']} on {r['device']})")
    row("corpus", f"{r['num_tokens']} tokens of pydoc_data in {r['windows']} windows of <= {r['window']}")
    row("KL mean / p99", f"{r['kl_mean']:.5f} / {r['kl_p99']:.5f}")
    row("top-1 agreement", _pct(r["top1_agreement"]))
    row("perplexity", f"{r['ppl_base']:.3f} -> {r['ppl_quant']:.3f} ({100 * r['ppl_change']:+.2f}%)")
    row("linear weights", f"{_mb(r['linear_bytes_16bit'])} in 16-bit -> {_mb(r['linear_bytes'])}")
    if "per_layer" in r:
        lines += ["", f"most sensitive projections (each quantized alone; {len(r['per_layer'])} in all):",
                  f"{'rank':>4}  {'module':<40} {'KL mean':>10} {'KL p99':>10} {'top-1':>7}"]
        for i, p in enumerate(r["per_layer"][:top], 1):
            lines.append(f"{i:>4}  {p['module']:<40} {p['kl_mean']:>10.5f} {p['kl_p99']:>10.5f} "
                         f"{_pct(p['top1_agreement']):>7}")
    if "mixed" in r:
        m = r["mixed"]
        # --skip-top may ask for more projections than there are: say how many were kept
        lines += ["", f"mixed precision, {len(m['kept_16bit'])} most sensitive kept in 16-bit:"]
        row("  KL mean / p99", f"{m['kl_mean']:.5f} / {m['kl_p99']:.5f} (all quantized: {r['kl_mean']:.5f})")
        row("  top-1 agreement", _pct(m["top1_agreement"]))
        row("  perplexity", f"{m['ppl_base']:.3f} -> {m['ppl_quant']:.3f} ({100 * m['ppl_change']:+.2f}%)")
        row("  linear weights", _mb(m["linear_bytes"]))
    if "replay" in r:
        p = r["replay"]
        lines += ["", f"replay of {p['prompts']} prompts (greedy):"]
        row("  first token", _pct(p["first_token_agreement"]))
        row("  exact match", _pct(p["exact_match_rate"]))
        stab = "n/a (no base answer was JSON)" if p["json_stability"] is None else \
            f"{_pct(p['json_stability'])} of {p['json_prompts']} base answers that were JSON"
        row("  JSON stability", stab)
    return "\n".join(lines)


def save_plot(r: dict[str, Any], path: str) -> None:
    """Per-token KL histogram, and per-projection sensitivity when it was measured."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = 2 if "per_layer" in r else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    kl = np.maximum(np.asarray(r["token_kl"]), 1e-8)
    ax = axes[0, 0]
    ax.hist(kl, bins=np.logspace(-8, max(0.0, np.log10(kl.max()) + 0.1), 60))
    ax.set_xscale("log")
    ax.set_xlabel("KL(base || quantized) per token")
    ax.set_ylabel("tokens")
    ax.set_title(f"{r['method']}, KV {r['kv_cache_dtype']}: mean {r['kl_mean']:.4f}")
    if panels == 2:
        ax = axes[0, 1]
        order = sorted(r["per_layer"], key=lambda p: p["index"])
        ax.bar(range(len(order)), [p["kl_mean"] for p in order])
        ax.set_yscale("log")
        ax.set_xlabel("projection (model order)")
        ax.set_ylabel("mean KL when quantized alone")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
