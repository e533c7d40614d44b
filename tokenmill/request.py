"""Request: one sequence being generated, and its state machine.

WAITING -> RUNNING -> FINISHED_{STOPPED,LENGTH,ABORTED,ERROR}; RUNNING -> PREEMPTED -> RUNNING.
A request with n > 1 samples is split by the engine into n Requests (one per sample) that share the
prompt's KV blocks through the prefix cache.
"""
from __future__ import annotations

import enum
import time

from tokenmill.outputs import Logprob, RequestMetrics
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


PENDING_TOKEN = -1  # stands for a sampled token still on the device
PRIORITY_LIMIT = 2 ** 31 - 1  # |priority| at most this: the scheduler ages priorities in float arithmetic

_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float | None = None, priority: int = 0, parent_id: str | None = None,
                 index: int = 0, timeout_s: float | None = None) -> None:
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.deadline = None if timeout_s is None else self.arrival_time + timeout_s
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0          # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.logprobs: list[Logprob] | None = [] if sampling_params.logprobs is not None else None
        self.prompt_logprobs: list[Logprob | None] | None = \
            [None] if sampling_params.prompt_logprobs is not None else None
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.block_hashes: list[int] = []   # chained hashes of this request's full blocks, filled lazily
        self.spec_token_ids: list[int] = []  # draft tokens to verify next step; never in all_token_ids
        self.output_text = ""
        self.sent_text_len = 0              # characters of output_text already streamed
        self.sent_token_len = 0             # output tokens already streamed
        self.error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    @property
    def prompt_logprobs_from(self) -> int | None:
        """The first prompt position whose logits still owe a prompt logprob (position p's give token p + 1's),
        None when none is owed. Positions from here on are computed, never taken from the prefix cache."""
        if self.prompt_logprobs is None or len(self.prompt_logprobs) >= self.num_prompt_tokens:
            return None
        return len(self.prompt_logprobs) - 1

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    # ---- async scheduling: a token sampled on the device, its value not yet read back ----------
    @property
    def has_pending_token(self) -> bool:
        """The last token is PENDING_TOKEN (token ids are never negative otherwise)."""
        return bool(self.all_token_ids) and self.all_token_ids[-1] == PENDING_TOKEN

    @property
    def num_known_tokens(self) -> int:
        return len(self.all_token_ids) - self.has_pending_token

    def append_pending_token(self) -> None:
        """Count a sampled token whose value is still on the device: the next step can be scheduled (it feeds
        the value from the device), and it must be resolved before anything reads it on the host."""
        self.append_token(PENDING_TOKEN)

    def resolve_pending_token(self, token_id: int | None) -> None:
        """Put the value in place, or drop the token (None: the request ended before it was read)."""
        if token_id is None:
            self.output_token_ids.pop()
            self.all_token_ids.pop()
        else:
            self.output_token_ids[-1] = self.all_token_ids[-1] = token_id

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
