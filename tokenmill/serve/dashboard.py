"""The web dashboard's time series: one point a second, kept for the last few minutes, so a page opened late still
sees the recent past."""
from __future__ import annotations

import time
from collections import deque
from typing import Any

from tokenmill.serve.metrics import Window


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


class Dashboard:
    def __init__(self, max_points: int = 300) -> None:
        self.points: deque[dict[str, Any]] = deque(maxlen=max_points)
        self._last: tuple[float, int] | None = None  # (time, generation_tokens_total) at the last sample

    def sample(self, stats: dict[str, Any], window: Window) -> None:
        now = time.time()
        generated = stats["generation_tokens_total"]
        rate = 0.0
        if self._last is not None and now > self._last[0]:
            rate = (generated - self._last[1]) / (now - self._last[0])
        self._last = (now, generated)
        self.points.append({
            "t": now,
            "running": stats["num_running"],
            "waiting": stats["num_waiting"],
            "kv_cache_usage": stats["kv_cache_usage"],
            "kv_cache_used_tokens": stats["kv_cache_used_tokens"],
            "prefill_batch": max(window.prefill_batches, default=0),
            "decode_batch": max(window.decode_batches, default=0),
            "ttft_s": _mean(window.ttfts),
            "tpot_s": _mean(window.tpots),
            "generation_tokens_per_s": rate,
        })

    def snapshot(self, stats: dict[str, Any]) -> dict[str, Any]:
        return {"stats": stats, "points": list(self.points)}
