"""Per-class latency percentiles, throughput, goodput and KV usage of a simulated (or replayed) run, as a terminal
table and as matplotlib plots. TTFT = first token − arrival, TPOT = (E2E − TTFT) / (output tokens − 1), E2E =
finish − arrival, as `bench serve` measures them; goodput = finished requests meeting every SLO, per second."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tokenmill.request import Request, RequestStatus
from tokenmill.sim.simulator import SimResult

PERCENTILES = (50, 90, 99)


@dataclass
class ClassStats:
    name: str
    num_requests: int
    finished: int
    failed: int                     # rejected at admission or timed out
    ttft: list[float]               # seconds, finished requests
    tpot: list[float]               # seconds, finished requests with >= 2 output tokens
    e2e: list[float]
    output_tokens: int
    prompt_tokens: int
    preemptions: int
    good: int                       # finished requests meeting every SLO

    def pct(self, metric: str, p: float) -> float:
        values = getattr(self, metric)
        return float(np.percentile(values, p)) if values else float("nan")

    def median(self, metric: str) -> float:
        return self.pct(metric, 50)


def _tpot(r: Request) -> float | None:
    m = r.metrics
    n = r.num_output_tokens
    if n < 2 or m.finished_time is None or m.first_token_time is None:
        return None
    return (m.finished_time - m.first_token_time) / (n - 1)


def class_stats(result: SimResult, slos: dict[str, float] | None = None) -> list[ClassStats]:
    """One entry per class in order of first appearance, then 'all' when there are several. SLOs in ms."""
    slos = slos or {}
    groups: dict[str, list[Request]] = {}
    for r in result.requests:
        groups.setdefault(result.classes[r.request_id], []).append(r)
    rejected: dict[str, int] = {}
    for r, _ in result.rejected:
        groups.setdefault(r.cls, [])
        rejected[r.cls] = rejected.get(r.cls, 0) + 1
    stats = [_stats(name, reqs, rejected.get(name, 0), slos) for name, reqs in groups.items()]
    if len(stats) > 1:
        stats.append(_stats("all", result.requests, len(result.rejected), slos))
    return stats


def _stats(name: str, reqs: list[Request], num_rejected: int, slos: dict[str, float]) -> ClassStats:
    done = [r for r in reqs if r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)]
    ttft = [r.metrics.time_to_first_token for r in done]
    e2e = [r.metrics.finished_time - r.metrics.arrival_time for r in done]
    tpot = [_tpot(r) for r in done]
    good = sum(all(v <= slos[k] / 1000 for k, v in (("ttft", a), ("tpot", b or 0.0), ("e2el", c)) if k in slos)
               for a, b, c in zip(ttft, tpot, e2e))
    return ClassStats(name, len(reqs) + num_rejected, len(done), len(reqs) - len(done) + num_rejected, ttft,
                      [t for t in tpot if t is not None], e2e, sum(r.num_output_tokens for r in done),
                      sum(r.num_prompt_tokens for r in done), sum(r.num_preemptions for r in reqs), good)


def _num(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def _triple(s: ClassStats, metric: str, scale: float) -> str:
    return "/".join(_num(s.pct(metric, p) * scale) for p in PERCENTILES)


def _table(header: list[str], rows: list[list[str]], title: str) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = [title] if title else []
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
              for r in [header] + rows]
    return "\n".join(lines)


def format_report(result: SimResult, slos: dict[str, float] | None = None, title: str = "") -> str:
    stats = class_stats(result, slos)
    p = "/".join(f"p{x}" for x in PERCENTILES)
    header = ["class", "requests", "done", "failed", f"TTFT {p} ms", f"TPOT {p} ms", f"E2E {p} ms", "preempt"]
    if slos:
        header.append("goodput/s")
    rows = []
    for s in stats:
        row = [s.name, str(s.num_requests), str(s.finished), str(s.failed), _triple(s, "ttft", 1e3),
               _triple(s, "tpot", 1e3), _triple(s, "e2e", 1e3), str(s.preemptions)]
        if slos:
            row.append(f"{s.good / result.duration:.2f}")
        rows.append(row)
    lines = [_table(header, rows, title)]
    total = stats[-1]
    used = [s.used_blocks for s in result.timeline] or [0]
    pool = max(result.usable_blocks, 1)
    lines.append(f"duration {result.duration:.2f} s, {result.num_steps} steps; throughput "
                 f"{total.finished / result.duration:.2f} req/s, {total.output_tokens / result.duration:,.1f} output "
                 f"tok/s, {(total.output_tokens + total.prompt_tokens) / result.duration:,.1f} total tok/s")
    lines.append(f"KV cache: pool {result.usable_blocks:,} blocks x {result.block_size} = "
                 f"{result.usable_blocks * result.block_size:,} tokens; peak {max(used):,} blocks "
                 f"({max(used) / pool:.0%}), mean {np.mean(used) / pool:.0%}; preemptions {result.num_preemptions}")
    if slos:
        lines.append("goodput SLOs: " + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()))
    for r, reason in result.rejected[:3]:
        lines.append(f"rejected {r.request_id}: {reason}")
    return "\n".join(lines)


def format_sweep(results: list[SimResult], slos: dict[str, float] | None = None, title: str = "") -> str:
    """One line per pool size: does this many blocks carry the load?"""
    header = ["blocks", "KV tokens", "done", "failed", "TTFT p99 ms", "TPOT p99 ms", "E2E p99 ms", "preempt",
              "peak KV", "req/s"] + (["goodput/s"] if slos else [])
    rows = []
    for r in results:
        s = class_stats(r, slos)[-1]
        peak = max((x.used_blocks for x in r.timeline), default=0)
        row = [f"{r.usable_blocks + 1:,}", f"{r.usable_blocks * r.block_size:,}", str(s.finished), str(s.failed),
               _num(s.pct("ttft", 99) * 1e3), _num(s.pct("tpot", 99) * 1e3), _num(s.pct("e2e", 99) * 1e3),
               str(r.num_preemptions), f"{peak / max(r.usable_blocks, 1):.0%}", f"{s.finished / r.duration:.2f}"]
        rows.append(row + ([f"{s.good / r.duration:.2f}"] if slos else []))
    return _table(header, rows, title)


def plot(result: SimResult, path: str, title: str = "") -> None:
    """KV usage and queue lengths over time, and the TTFT and TPOT distributions per class."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    t = [s.time - result.start for s in result.timeline]
    ax[0, 0].plot(t, [s.used_blocks for s in result.timeline], label="blocks in use")
    ax[0, 0].axhline(result.usable_blocks, color="red", linestyle="--", label="pool")
    ax[0, 0].set(title="KV cache", xlabel="time (s)", ylabel="blocks")
    ax[0, 1].plot(t, [s.running for s in result.timeline], label="running")
    ax[0, 1].plot(t, [s.waiting for s in result.timeline], label="waiting")
    ax[0, 1].set(title="requests", xlabel="time (s)")
    for s in class_stats(result):
        for a, metric in ((ax[1, 0], "ttft"), (ax[1, 1], "tpot")):
            values = np.sort(np.array(getattr(s, metric)) * 1e3)
            if len(values):
                a.plot(values, np.arange(1, len(values) + 1) / len(values), label=s.name)
    ax[1, 0].set(title="TTFT CDF", xlabel="ms", xscale="log")
    ax[1, 1].set(title="TPOT CDF", xlabel="ms", xscale="log")
    for a in ax.flat:
        a.legend()
        a.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
