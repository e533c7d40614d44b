"""Prometheus metrics with vLLM's names under a `tokenmill:` prefix.

Per-request latencies and per-step batch sizes are observed as the async engine reports them; the engine's own
counters and gauges (tokens, prefix cache, preemptions, KV cache) are read from a stats snapshot taken between two
steps when /metrics is scraped. Each app has its own registry, so several servers can live in one process."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenmill.engine.llm_engine import StepStats
from tokenmill.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ABORT_REASONS = ("client_disconnect", "timeout", "error", "shutdown")
REJECT_REASONS = ("queue_full", "draining")


@dataclass
class Window:
    """What happened since the dashboard's last sample."""

    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    prefill_batches: list[int] = field(default_factory=list)
    decode_batches: list[int] = field(default_factory=list)


class _EngineStatsCollector:
    """The engine's cumulative counters and current gauges, from the last stats snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        s, labels = self.stats, [self.model_name]
        if not s:
            return
        used = s["kv_cache_used_tokens"]
        gauges = [
            ("num_requests_running", "requests in the running batch", s["num_running"]),
            ("num_requests_waiting", "requests waiting to be scheduled", s["num_waiting"]),
            ("kv_cache_usage_perc", "fraction of KV cache blocks in use (0-1)", s["kv_cache_usage"]),
            ("kv_cache_used_tokens", "token slots of the KV cache blocks in use", used),
            ("kv_cache_total_tokens", "token slots of the whole KV cache", s["num_blocks_total"] * s["block_size"]),
            ("kv_cache_block_utilization", "fraction of the slots of the blocks in use that hold a token",
             s["kv_cache_filled_slots"] / used if used else 0.0),
            ("spec_decode_acceptance_rate", "accepted / proposed draft tokens", s["spec_acceptance_rate"]),
            ("spec_decode_mean_accepted_length", "tokens emitted per verification of a request's drafts",
             s["spec_mean_accepted_length"]),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
            g.add_metric(labels, value)
            yield g
        counters = [
            ("prompt_tokens", "prompt tokens admitted", s["prompt_tokens_total"]),
            ("generation_tokens", "tokens generated", s["generation_tokens_total"]),
            ("prefix_cache_queries", "prompt tokens looked up in the prefix cache", s["prefix_cache_queries"]),
            ("prefix_cache_hits", "prompt tokens found in the prefix cache", s["prefix_cache_hits"]),
            ("num_preemptions", "requests preempted to free KV cache blocks", s["num_preemptions"]),
            ("spec_decode_num_drafts", "verifications of a request's draft tokens", s["spec_num_verifications"]),
            ("spec_decode_num_draft_tokens", "draft tokens proposed", s["spec_num_draft_tokens"]),
            ("spec_decode_num_accepted_tokens", "draft tokens accepted", s["spec_num_accepted_tokens"]),
            ("spec_decode_draft_seconds", "seconds spent proposing draft tokens", s["spec_draft_time_s"]),
            ("spec_decode_verify_seconds", "seconds of engine steps that verified draft tokens",
             s["spec_verify_time_s"]),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            yield c


class ServerMetrics:
    """The server's metrics; also the async engine's observer."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.engine_stats = _EngineStatsCollector(model_name)
        self.registry.register(self.engine_stats)
        labels = {"labelnames": ["model_name"], "registry": self.registry}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"tokenmill:{name}", doc, buckets=buckets, **labels).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "time to first token (arrival to first token)", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "time between two outputs of a request", TOKEN_LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "mean time per output token after the first",
                         TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "arrival to last token", REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "arrival to first scheduled", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "first scheduled to first token (prefill latency)",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "first token to last token (decode latency)",
                                REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "prompt tokens per finished request", COUNT_BUCKETS)
        self.generation_tokens = hist("request_generation_tokens", "generated tokens per finished request",
                                      COUNT_BUCKETS)
        self.batch_prefill = hist("batch_size_prefill", "requests prefilling in one engine step", COUNT_BUCKETS)
        self.batch_decode = hist("batch_size_decode", "requests decoding in one engine step", COUNT_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "tokens computed in one engine step", COUNT_BUCKETS)
        self.success = Counter("tokenmill:request_success", "finished requests, by finish reason",
                               labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.aborts = Counter("tokenmill:request_abort", "aborted requests, by reason",
                              labelnames=["model_name", "reason"], registry=self.registry)
        self.rejected = Counter("tokenmill:request_rejected", "requests refused before reaching the engine, by reason",
                                labelnames=["model_name", "reason"], registry=self.registry)
        self.oom = Counter("tokenmill:oom", "out-of-memory errors raised by an engine step",
                           **labels).labels(model_name)
        for reason in ABORT_REASONS:
            self.aborts.labels(model_name, reason)
        for reason in REJECT_REASONS:
            self.rejected.labels(model_name, reason)
        for reason in ("stop", "length"):
            self.success.labels(model_name, reason)
        self.model_name = model_name
        self._last_token_time: dict[str, float] = {}
        self.window = Window()

    # ---- observer ---------------------------------------------------------------------------
    def on_step(self, step: StepStats) -> None:
        if step.num_prefill_reqs:
            self.batch_prefill.observe(step.num_prefill_reqs)
        if step.num_decode_reqs:
            self.batch_decode.observe(step.num_decode_reqs)
        tokens = step.num_prefill_tokens + step.num_decode_tokens
        if tokens:
            self.iteration_tokens.observe(tokens)
        self.window.prefill_batches.append(step.num_prefill_reqs)
        self.window.decode_batches.append(step.num_decode_reqs)

    def on_output(self, out: RequestOutput) -> None:
        m = out.metrics
        rid = out.request_id
        if m is not None and m.last_token_time is not None:
            last = self._last_token_time.get(rid)
            if last is None:
                ttft = m.first_token_time - m.arrival_time
                self.ttft.observe(ttft)
                self.window.ttfts.append(ttft)
            elif m.last_token_time > last:
                self.itl.observe(m.last_token_time - last)
            self._last_token_time[rid] = m.last_token_time
        if not out.finished:
            return
        self._last_token_time.pop(rid, None)
        reasons = {c.finish_reason for c in out.outputs}
        if m is None or m.first_token_time is None or not reasons <= {"stop", "length"}:
            return
        for c in out.outputs:
            self.success.labels(self.model_name, c.finish_reason).inc()
            self.generation_tokens.observe(len(c.token_ids))
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        end = m.finished_time if m.finished_time is not None else m.last_token_time
        self.e2e.observe(end - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        self.decode_time.observe(m.last_token_time - m.first_token_time)
        tpot = m.time_per_output_token
        if tpot is not None:
            self.tpot.observe(tpot)
            self.window.tpots.append(tpot)

    def on_abort(self, reason: str, request_id: str) -> None:
        """An aborted request never reports a finished output: its inter-token clock goes here, or it stays."""
        self.aborts.labels(self.model_name, reason).inc()
        self._last_token_time.pop(request_id, None)

    def on_oom(self) -> None:
        self.oom.inc()

    # ---- serving side -----------------------------------------------------------------------
    def on_reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def take_window(self) -> Window:
        window, self.window = self.window, Window()
        return window

    def render(self, engine_stats: dict[str, Any]) -> bytes:
        """The Prometheus text exposition, with the engine's gauges and counters as of `engine_stats`."""
        self.engine_stats.stats = engine_stats
        return generate_latest(self.registry)
