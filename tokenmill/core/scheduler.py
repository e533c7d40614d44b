"""Iteration-level scheduler: every step picks a mixed batch of decode tokens and prompt chunks
under a token budget, admits waiting requests as blocks allow, and preempts when blocks run out.

There is no prefill phase and decode phase: each request has num_computed_tokens catching up with
num_tokens, and a step gives it as many tokens as the budget allows (chunked prefill)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.request import Request, RequestStatus


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue_len; the server answers 429."""


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_spec_tokens: int = 0    # of num_new_tokens, draft tokens to verify (the last ones)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so it yields logits to sample."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens + self.num_spec_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    timed_out: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_reqs: int = 0
    num_decode_reqs: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_aborts: int = 0
    num_timeouts: int = 0
    num_rejected: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.clock: Callable[[], float] = time.monotonic   # the simulator swaps in its virtual clock

    # ---- admission -------------------------------------------------------------------------
    @property
    def max_request_len(self) -> int:
        """The most tokens one request can reach: the context limit, or the whole KV cache where that is smaller."""
        return min(self.config.max_model_len, self.kv_cache.usable_blocks * self.kv_cache.block_size)

    def check_request(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Reject, with the reason, a request that could never run."""
        limit = self.config.max_model_len
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty; at least one token is required")
        if num_prompt_tokens >= limit:
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens but the maximum context length "
                             f"(max_model_len) is {limit}, which must also leave room for at least one new token")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                             f"{num_prompt_tokens + max_tokens} exceeds the maximum context length {limit}")
        max_len = min(num_prompt_tokens + (max_tokens or limit), limit)
        need = self.kv_cache.blocks_needed(max_len)
        if need > self.kv_cache.usable_blocks:
            raise ValueError(f"the request may grow to {max_len} tokens, {need} KV blocks, but the whole cache has "
                             f"{self.kv_cache.usable_blocks}; raise kv_cache_memory, lower max_tokens or "
                             "shorten the prompt")

    def add_request(self, request: Request) -> None:
        if len(self.waiting) >= self.config.max_queue_len:
            self.stats.num_rejected += 1
            raise QueueFullError(f"the waiting queue is full ({self.config.max_queue_len} requests); retry later")
        self.check_request(request.num_prompt_tokens, request.sampling_params.max_tokens)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    # ---- one step --------------------------------------------------------------------------
    def _urgency(self, request: Request, now: float) -> tuple[float, float]:
        """Sort key, most urgent first: arrival (fcfs), or priority lowered by one per priority_aging_s waited
        (priority), then arrival. Admission and preemption use the same key, so a request preempted for another
        never outranks it on the way back in."""
        if self.config.policy == "fcfs":
            return (0.0, request.arrival_time)
        aged = request.priority - (now - request.arrival_time) // self.config.priority_aging_s
        return (aged, request.arrival_time)

    def _waiting_order(self, now: float) -> list[Request]:
        return sorted(self.waiting, key=lambda r: self._urgency(r, now))

    def _victim(self, candidates: list[Request], now: float) -> Request:
        """Whom to preempt: the least urgent (fcfs: the newest)."""
        return max(candidates, key=lambda r: self._urgency(r, now))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.append(request)

    def _cap(self, num_new: int, budget: int, long_slots: list[int]) -> int:
        """Apply the token budget and the long-prompt cap; 0 means 'not this step'."""
        threshold = self.config.long_prefill_token_threshold
        if threshold and num_new > threshold:
            if long_slots[0] <= 0:
                return 0
            long_slots[0] -= 1
            num_new = threshold
        return min(num_new, budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.kv_cache.begin_step()
        now = self.clock()
        for req in [r for r in self.requests.values() if r.deadline is not None and now > r.deadline]:
            self.finish_request(req, RequestStatus.FINISHED_ABORTED, reason="timeout")
            self.stats.num_timeouts += 1
            out.timed_out.append(req)
        if self.config.policy == "priority":
            self._preempt_for_urgent(now, out)
        num_urgent_preempted = len(out.preempted)
        if self.config.policy == "priority":  # most urgent first: when blocks run short, a less urgent one yields
            self.running.sort(key=lambda r: self._urgency(r, now))
        budget = self.config.max_num_batched_tokens
        long_slots = [self.config.max_long_partial_prefills]
        scheduled_ids: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            max_tokens = req.sampling_params.max_tokens
            if req.has_pending_token and max_tokens is not None and req.num_output_tokens >= max_tokens:
                i += 1  # its last token is on the device and ends it (async scheduling): nothing to compute
                continue
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > 1:  # a prefill chunk leaves a token each to the decodes served after it (priority order)
                room = budget - sum(1 for r in self.running[i + 1:]
                                    if r.num_tokens - r.num_computed_tokens == 1 and r.request_id not in scheduled_ids)
                num_new = self._cap(num_new, room, long_slots) if room > 0 else 0
            else:
                num_new = min(num_new, budget)
            if num_new <= 0:
                i += 1
                continue
            num_spec = 0
            if req.spec_token_ids:  # draft tokens ride after the last token, in the budget left
                reaches_end = num_new == req.num_tokens - req.num_computed_tokens
                num_spec = min(len(req.spec_token_ids), budget - num_new) if reaches_end else 0
                del req.spec_token_ids[num_spec:]
            while not self.kv_cache.allocate_slots(req, num_new + num_spec):
                if num_spec:  # speculation never costs a preemption: drop the drafts first
                    num_spec, req.spec_token_ids = 0, []
                    continue
                victim = self._victim([r for r in self.running if r.request_id not in scheduled_ids], now)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
                i = self.running.index(req)
            else:
                out.scheduled.append(ScheduledRequest(req, num_new + num_spec, num_spec))
                scheduled_ids.add(req.request_id)
                budget -= num_new + num_spec
                i += 1
        if len(out.preempted) == num_urgent_preempted:  # blocks ran short while decoding: admit nobody
            self._admit(now, budget, long_slots, out)
        for s in out.scheduled:
            if s.request.num_computed_tokens < s.request.num_prompt_tokens:
                out.num_prefill_tokens += s.num_new_tokens
                out.num_prefill_reqs += 1
            else:
                out.num_decode_tokens += s.num_new_tokens
                out.num_decode_reqs += 1
        return out

    def _admit(self, now: float, budget: int, long_slots: list[int], out: SchedulerOutput) -> None:
        preempted = {r.request_id for r in out.preempted}  # made room for a more urgent one this step
        for req in self._waiting_order(now):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or req.request_id in preempted:
                break  # nothing at or below the urgency of a request just preempted gets in this step
            computed, num_hit = self.kv_cache.get_computed_blocks(req)
            num_new = self._cap(req.num_tokens - num_hit, budget, long_slots)
            if num_new <= 0:
                continue
            if not self.kv_cache.allocate_slots(req, num_new, computed):
                break
            if req.status == RequestStatus.WAITING:
                self.kv_cache.prefix_queries += req.num_prompt_tokens
                self.kv_cache.prefix_hits += num_hit
                req.num_cached_tokens = num_hit
                req.metrics.first_scheduled_time = now
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.waiting.remove(req)
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

    def _preempt_for_urgent(self, now: float, out: SchedulerOutput) -> None:
        """Under the priority policy, free blocks for the most urgent waiting request by preempting
        strictly less urgent running ones, before anything is scheduled this step."""
        if not self.waiting or not self.running:
            return
        head = self._waiting_order(now)[0]
        need = self.kv_cache.blocks_needed(min(head.num_tokens, self.config.max_num_batched_tokens) + 1)
        while self.kv_cache.num_free_blocks < need or len(self.running) >= self.config.max_num_seqs:
            victim = self._victim(self.running, now)
            if self._urgency(victim, now)[0] <= self._urgency(head, now)[0]:
                return
            self._preempt(victim)
            out.preempted.append(victim)
            if not self.running:
                return

    # ---- after the forward -----------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if s.num_spec_tokens:
                req.spec_token_ids = []
            token = sampled.get(req.request_id)
            if token is not None:
                req.append_token(token)

    def rollback_rejected(self, request: Request) -> None:
        """After a verification step: every token but the newest (sampled, not yet computed) one has valid K/V,
        accepted drafts included; the slots past them held rejected drafts, and blocks holding only those
        go back to the pool."""
        request.num_computed_tokens = request.num_tokens - 1
        self.kv_cache.trim(request, request.num_computed_tokens)

    def finish_request(self, request: Request, status: RequestStatus, reason: int | str | None = None) -> None:
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = status
        if reason is not None:
            request.stop_reason = reason
        self.requests.pop(request.request_id, None)

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.finish_request(req, RequestStatus.FINISHED_ABORTED, reason="abort")
        self.stats.num_aborts += 1
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
