"""What the engine sees of speculative decoding: after each step it proposes draft tokens for the requests
that just sampled (the scheduler then schedules 1 + k tokens for each: the newest token and its drafts), it
runs and times the verifying steps, and it applies the adaptive rule (spec/adaptive.py) with the acceptance
statistics it keeps."""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenmill.config import EngineArgs
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.request import Request
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.sampler import SamplerOutput
from tokenmill.spec.adaptive import COST_DECAY, Acceptance, StepCost, best_k, net_gain
from tokenmill.spec.draft import DraftModel, DraftProposer
from tokenmill.spec.ngram import NgramProposer
from tokenmill.spec.rejection_sampler import VerifyOutput


@dataclass
class SpecStats:
    num_verifications: int = 0      # (request, step) pairs that carried draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_time_s: float = 0.0       # proposing
    verify_time_s: float = 0.0      # target steps that verified drafts
    cost_per_token: float = 0.0     # the adaptive rule's last c ...
    overhead_tokens: float = 0.0    # ... and O (spec/adaptive.py)

    def as_dict(self) -> dict[str, Any]:
        n, d, a = self.num_verifications, self.num_draft_tokens, self.num_accepted_tokens
        return {
            "spec_num_verifications": n,
            "spec_num_draft_tokens": d,
            "spec_num_accepted_tokens": a,
            "spec_acceptance_rate": a / d if d else 0.0,
            "spec_mean_accepted_length": (a + n) / n if n else 0.0,   # tokens emitted per verification
            "spec_draft_time_s": self.draft_time_s,
            "spec_verify_time_s": self.verify_time_s,
            "spec_cost_per_token": self.cost_per_token,
            "spec_overhead_tokens": self.overhead_tokens,
        }


class Speculator:
    def __init__(self, args: EngineArgs, runner: ModelRunner, kv_cache: KVCacheManager, scheduler: Scheduler,
                 draft: DraftModel | None) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.max_k = args.num_speculative_tokens
        self.max_model_len = runner.max_model_len
        if draft is None:
            self.proposer: NgramProposer | DraftProposer = NgramProposer(args.prompt_lookup_max, args.prompt_lookup_min)
        else:
            self.proposer = DraftProposer(draft, args, kv_cache, runner.num_blocks, runner.config.vocab_size,
                                          runner.device, runner.dtype, runner.max_model_len,
                                          runner.sampler.eos_token_ids)
        self.rejection_sampler = runner.rejection_sampler
        self.acceptance: dict[str, Acceptance] = {}
        self.shadow: dict[str, tuple[int, list[int]]] = {}   # request id -> (position, unverified n-gram draft)
        self.cost = StepCost()
        self.adaptive = True   # False: always propose num_speculative_tokens (tests, raw-mechanism benchmarks)
        self.draft_seconds_per_token: float | None = None   # exponentially weighted
        self.stats = SpecStats()

    def execute(self, out: SchedulerOutput, block_ids: list[list[int]]) -> SamplerOutput | VerifyOutput:
        """The runner's step, timed for the cost model; verification outcomes feed the acceptance rates."""
        t0 = time.perf_counter()
        result = self.runner.execute(out, block_ids)
        elapsed = time.perf_counter() - t0
        if not out.num_prefill_tokens:
            self.cost.observe(out.num_decode_tokens, elapsed, isinstance(result, VerifyOutput))
        if isinstance(result, VerifyOutput):
            self.stats.verify_time_s += elapsed
            reqs = [s.request for s in out.scheduled if s.samples]
            for r, tokens, k in zip(reqs, result.token_ids, result.num_drafts):
                if k:
                    self.acceptance.setdefault(r.request_id, Acceptance()).update(k, len(tokens) - 1)
                    self.stats.num_verifications += 1
                    self.stats.num_draft_tokens += k
                    self.stats.num_accepted_tokens += len(tokens) - 1
        return result

    def propose(self, reqs: list[Request]) -> None:
        """Draft tokens for running requests that just sampled a token, as many as the adaptive rule says."""
        self._forget_finished()
        c, overhead = self.cost.costs(max(len(self.scheduler.running), 1), self.draft_seconds_per_token or 0.0)
        self.stats.cost_per_token, self.stats.overhead_tokens = c, overhead
        if self.adaptive and c >= 1.0:     # even certain acceptance would not pay: the batch is too large
            return
        ks = []
        for r in reqs:
            acc = self.acceptance.setdefault(r.request_id, Acceptance())
            self._settle_shadow(r, acc)
            limit = self.max_model_len - r.num_tokens
            if r.sampling_params.max_tokens is not None:
                limit = min(limit, r.sampling_params.max_tokens - r.num_output_tokens - 1)
            ks.append(min(best_k(acc.alpha, c, self.max_k) if self.adaptive else self.max_k, limit))
        if self.adaptive and sum(net_gain(self.acceptance[r.request_id].alpha, k, c)
                                 for r, k in zip(reqs, ks) if k > 0) <= overhead:
            ks = [0] * len(reqs)
        chosen = [(r, k) for r, k in zip(reqs, ks) if k > 0]
        self._watch(r for r, k in zip(reqs, ks) if k <= 0)
        if not chosen:
            return
        t0 = time.perf_counter()
        drafts, probs = self.proposer.propose([r for r, _ in chosen], [k for _, k in chosen])
        elapsed = time.perf_counter() - t0
        self.stats.draft_time_s += elapsed
        steady = elapsed - self.proposer.one_off_seconds   # a draft model's catch-up on a new prompt is prefill
        num = sum(len(d) for d in drafts)
        if num:
            prev = self.draft_seconds_per_token
            self.draft_seconds_per_token = steady / num if prev is None else (
                COST_DECAY * prev + (1 - COST_DECAY) * steady / num)
        for (r, _), d, q in zip(chosen, drafts, probs):
            r.spec_token_ids = d
            self.rejection_sampler.draft_probs.pop(r.request_id, None)
            if q is not None and d:
                self.rejection_sampler.draft_probs[r.request_id] = q

    def _watch(self, reqs: Iterable[Request]) -> None:
        """Requests not speculating keep their acceptance rate current. A free proposer (n-gram) drafts for
        them anyway without verifying; the drafts are scored against the tokens that come next (a draft token
        matches a sampled one with probability p(x), its acceptance probability). A draft model costs time,
        so there the rate drifts back towards the prior instead, and the request is probed again later."""
        for r in reqs:
            if not isinstance(self.proposer, NgramProposer):
                self.acceptance[r.request_id].recover()
            elif r.request_id not in self.shadow and r.num_tokens < self.max_model_len:
                draft = self.proposer.propose([r], [self.max_k])[0][0]
                if draft:
                    self.shadow[r.request_id] = (r.num_tokens, draft)

    def _settle_shadow(self, r: Request, acc: Acceptance) -> None:
        """Score a pending unverified draft once the tokens that followed it are known."""
        if r.request_id not in self.shadow:
            return
        start, draft = self.shadow[r.request_id]
        came = r.all_token_ids[start:start + len(draft)]
        a = 0
        while a < len(came) and came[a] == draft[a]:
            a += 1
        if a < len(came) or len(came) == len(draft):
            acc.update(len(draft), a)
            del self.shadow[r.request_id]

    def _forget_finished(self) -> None:
        live = self.scheduler.requests
        for rid in [rid for rid in self.acceptance if rid not in live]:
            del self.acceptance[rid]
            self.shadow.pop(rid, None)
            self.proposer.forget(rid)
            self.rejection_sampler.draft_probs.pop(rid, None)

    def get_stats(self) -> dict[str, Any]:
        return self.stats.as_dict()
