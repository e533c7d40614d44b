"""What the engine returns: vLLM's RequestOutput / CompletionOutput shapes."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of the chosen token and the top alternatives at one position."""

    token_id: int
    logprob: float
    top: dict[int, float]  # token id -> logprob, best first
    rank: int | None = None  # 1 + how many tokens were more likely (vLLM's)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generated: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None or self.num_generated < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated - 1)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]  # the request's own list, not a copy (no O(n) copy per step): copy to keep a snapshot
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    logprobs: list[Logprob] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the chosen tokens' logprobs; None unless the request asked for logprobs."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # SamplingParams.prompt_logprobs: one entry a prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[Logprob | None] | None = None
