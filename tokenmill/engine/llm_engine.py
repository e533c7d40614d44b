"""LLMEngine: add_request / step / abort_request. Synchronous and single-threaded; the async server
loop drives it from one background task. With tensor_parallel_size > 1 it is rank 0: it starts the other
ranks (engine/tp_launcher.py), which replay each step's forward."""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from tokenmill.config import EngineArgs, SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.scheduler import QueueFullError, Scheduler, SchedulerOutput
from tokenmill.distributed import tp_size
from tokenmill.engine.detokenizer import Detokenizer, check_stop
from tokenmill.engine.devices import pick_device, pick_dtype
from tokenmill.engine.tp_launcher import TPWorkerGroup
from tokenmill.model.generation_config import default_sampling, max_tokens_cap
from tokenmill.model.loader import load_model, load_model_config, resolve_model
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.request import PRIORITY_LIMIT, Request, RequestStatus
from tokenmill.runner.model_runner import LaunchedStep, ModelRunner
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, truncated_prompt
from tokenmill.spec.draft import load_draft
from tokenmill.spec.rejection_sampler import VerifyOutput
from tokenmill.spec.speculator import SpecStats, Speculator
from tokenmill.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "QueueFullError", "pick_device", "pick_dtype"]

T = TypeVar("T")


@dataclass
class _Group:
    """The n samples of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[Detokenizer]
    sent_tokens: list[int] = field(default_factory=list)


@dataclass
class StepStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_reqs: int = 0
    num_decode_reqs: int = 0
    step_time: float = 0.0


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        if tp_size() > 1:
            raise RuntimeError("a tensor-parallel engine is running in this process (its layers and collectives are "
                               "process-wide); shut it down (LLMEngine.shutdown) before starting another engine")
        self.args = args
        torch.manual_seed(args.seed)
        self.device = pick_device(args.device)
        model_path = resolve_model(args.model) if args.load_format != "dummy" or args.model else None
        self.model_path = model_path
        self.model_config = load_model_config(model_path, args.load_format, args.model_preset)
        # SamplingParams keywords that requests leaving them unset take (LLM.get_default_sampling_params, the server)
        self.default_sampling = default_sampling(args.generation_config, model_path, args.override_generation_config)
        self.max_tokens_cap = max_tokens_cap(args.generation_config, self.default_sampling,
                                             args.override_generation_config)
        self.dtype = pick_dtype(args.dtype, self.model_config.torch_dtype, self.device)
        max_len = args.max_model_len or self.model_config.max_position_embeddings
        if max_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings "
                             f"{self.model_config.max_position_embeddings}")
        self.max_model_len = max_len
        tok_path = None if args.skip_tokenizer_init else args.tokenizer or model_path
        self.tokenizer: Tokenizer | None = load_tokenizer(tok_path) if tok_path else None
        eos = list(self.model_config.eos_token_id)
        if self.tokenizer is not None:
            eos = sorted(set(eos) | set(self.tokenizer.eos_token_ids))
        self.eos_token_ids = eos
        self.workers = TPWorkerGroup(args, self.model_config, self.device) if args.tensor_parallel_size > 1 else None
        if self.workers is not None:
            weakref.finalize(self, self.workers.shutdown)
        try:
            with self._watch_workers():
                model = load_model(self.model_config, model_path, args.load_format, self.dtype, self.device,
                                   seed=args.seed, quantization=args.quantization, fold_norms=True,
                                   quantize_lm_head=args.quantize_lm_head)
                draft = load_draft(args, model_path, self.device, self.dtype) \
                    if (args.speculative or "").startswith("draft:") else None
                self.runner = ModelRunner(model, self.model_config, args, self.device, self.dtype, max_len, eos,
                                          extra_kv_bytes_per_token=draft.kv_bytes_per_token if draft else 0)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown(graceful=False)
            raise
        if self.workers is not None:
            self.workers.start_keepalive()
        self.kv_cache = KVCacheManager(self.runner.num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            max_model_len=max_len, policy=args.scheduling_policy, max_queue_len=args.max_queue_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            max_long_partial_prefills=args.max_long_partial_prefills,
            priority_aging_s=args.priority_aging_s, timeout_s=args.timeout_s), self.kv_cache)
        self.spec = Speculator(args, self.runner, self.kv_cache, self.scheduler, draft) if args.speculative else None
        self.groups: dict[str, _Group] = {}
        self.child_to_group: dict[str, _Group] = {}
        self._pending: dict[int, _Group] = {}   # by id(): groups with something to report at the next step
        self.last_step = StepStats()
        self._in_flight: LaunchedStep | None = None  # async scheduling: a step whose tokens are not read back
        self.num_generation_tokens = 0
        self.num_prompt_tokens = 0
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> "LLMEngine":
        return cls(EngineArgs(**kwargs))

    # ---- tensor-parallel ranks --------------------------------------------------------------
    def _watch_workers(self) -> contextlib.AbstractContextManager[None]:
        return self.workers.watch() if self.workers is not None else contextlib.nullcontext()

    def collective_rpc(self, fn: Callable[[ModelRunner], T]) -> list[T]:
        """fn(model runner) on every tensor-parallel rank, results in rank order; fn must be importable."""
        if self.workers is None:
            return [fn(self.runner)]
        return self.workers.collective_rpc(fn, self.runner)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers; also done when the engine is garbage collected or Python exits."""
        if self.workers is not None:
            self.workers.shutdown()

    # ---- requests ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (dummy weights): pass token ids, not text")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be in [0, {vocab}); got {bad[:5]}")
        return None, list(prompt)

    def _check_a_token_is_allowed(self, params: SamplingParams) -> None:
        """allowed_token_ids that the request's other bans cover would leave every logit -inf, and the sampler
        would answer with a token it was told not to (vLLM's too): the caller's error, found on arrival. A
        multi-token bad word bans its last token only after the rest, which no check on arrival can foresee: the
        sampler lifts such words for a step where they would ban every allowed token (Sampler._apply_bad_words)."""
        if params.allowed_token_ids is None:
            return
        left = set(params.allowed_token_ids) - {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}
        if not left:
            raise ValueError(f"bad_words ban every token of allowed_token_ids {params.allowed_token_ids[:8]}; "
                             "allow a token that no bad word is spelled with alone")
        if params.min_tokens and not left - set(params.banned_before_min_tokens(self.eos_token_ids)):
            raise ValueError(f"min_tokens={params.min_tokens} bans EOS and stop_token_ids until then, and "
                             f"allowed_token_ids {sorted(left)[:8]} has no other token; allow one, or drop "
                             "min_tokens")

    def add_request(self, request_id: str | None, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, timeout_s: float | None = None) -> str:
        """Queue a request; raises ValueError for bad input and QueueFullError when the queue is full."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string or None, got {type(request_id).__name__} {request_id!r}")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if (not isinstance(priority, int) or isinstance(priority, bool)
                or not -PRIORITY_LIMIT <= priority <= PRIORITY_LIMIT):
            raise ValueError(f"priority must be an integer in [-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}], got {priority!r}")
        if priority and self.scheduler.config.policy != "priority":  # as vLLM: it would be ignored silently
            raise ValueError(f"priority {priority} was given but priority scheduling is not enabled; "
                             "start the engine with scheduling_policy='priority'")
        for name, value in (("arrival_time", arrival_time), ("timeout_s", timeout_s)):
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number of seconds or None, got {value!r}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds (None: the engine's timeout_s), got {timeout_s!r}")
        text, ids = self.encode_prompt(prompt)
        if params.truncate_prompt_tokens is not None:  # the text stays as given, as vLLM reports it
            ids = truncated_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        params.verify_vocab(self.model_config.vocab_size)
        self.scheduler.check_request(len(ids), params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer to read the output, and this engine has "
                             "none (skip_tokenizer_init); use stop_token_ids")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError(f"bad_words {params.bad_words!r} need a tokenizer to spell them in tokens, and this "
                                 "engine has none (skip_tokenizer_init); use bad_words_token_ids")
            params.bad_words_token_ids = self.tokenizer.bad_words_token_ids(params.bad_words)
        self._check_a_token_is_allowed(params)
        if params.n > self.scheduler.config.max_queue_len:  # a retry could never make room for them
            raise ValueError(f"n={params.n} samples never fit the waiting queue of "
                             f"{self.scheduler.config.max_queue_len} requests; allowed: n <= max_queue_len")
        if len(self.scheduler.waiting) + params.n > self.scheduler.config.max_queue_len:
            self.scheduler.stats.num_rejected += 1
            raise QueueFullError(f"the waiting queue is full ({self.scheduler.config.max_queue_len} requests); "
                                 "retry later")
        timeout = timeout_s if timeout_s is not None else self.args.timeout_s
        now = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = SamplingParams(**{  # the prompt's logprobs are the first sample's to compute
                    **params.__dict__, "n": 1, "seed": None if params.seed is None else (params.seed + i) % 2 ** 63,
                    "prompt_logprobs": params.prompt_logprobs if i == 0 else None})
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, ids, child_params, now, priority, request_id, i, timeout))
        taken = next((c.request_id for c in children  # a finished sample's id stays taken until its group ends
                      if c.request_id in self.scheduler.requests or c.request_id in self.child_to_group), None)
        if taken is not None:  # checked for all samples first: none is queued when one cannot be
            of = f" (sample of {request_id!r})" if params.n > 1 else ""
            raise ValueError(f"request id {taken!r}{of} is already in use")
        group = _Group(request_id, text, ids, children, [Detokenizer(self.tokenizer, c) for c in children]
                       if self.tokenizer is not None else [], [0] * params.n)
        for c in children:
            self.scheduler.add_request(c)
            self.child_to_group[c.request_id] = group
        self.groups[request_id] = group
        self.num_prompt_tokens += len(ids)
        return request_id

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort (all samples of) a request now: its blocks are freed and its id is free again before this call
        returns (as in vLLM); the next step still reports it once, finished with finish_reason "abort"."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        for rid in ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            for c in group.children:
                if not c.is_finished:
                    self.scheduler.abort_request(c.request_id)
                    self.runner.sampler.forget(c.request_id)
                self.child_to_group.pop(c.request_id, None)
            self._pending[id(group)] = group

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes (vLLM's), e.g. between benchmark runs: a later prompt finds none, except in
        the blocks that requests still running hold."""
        self.kv_cache.reset_prefix_cache()

    # ---- one iteration ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and report one step. With async scheduling a step that needs no token value on the
        host is launched before the previous step's tokens are read back, so the host's work for one step
        overlaps the device's work for the other; its own tokens are reported by the next call."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        for req in out.timed_out:  # as an abort: a seeded generator kept would go on in a request reusing the id
            self.runner.sampler.forget(req.request_id)
            group = self.child_to_group[req.request_id]
            self._pending[id(group)] = group
        if not out.is_empty and self._can_launch_ahead(out):
            with self._watch_workers():
                try:
                    launched = self.runner.launch(out, self._block_ids(out), self._in_flight)
                except BaseException:
                    # sampling may have overwritten the runner's `sampled` buffer before failing: the step in
                    # flight is read back from its own host copy, so the next launch takes no token from it
                    self._read_back_in_flight()
                    raise
                self._read_back_in_flight()
            self.scheduler.update_from_output(out, {})
            for req in launched.reqs:
                if not req.is_finished:
                    req.append_pending_token()
            self._in_flight = launched
        else:
            self._read_back_in_flight()
            out.scheduled = [s for s in out.scheduled if not s.request.is_finished]  # ended by that step
            if not out.is_empty:
                self._run_step(out)
        self._record_step(out, time.perf_counter() - t0)
        return self._collect_outputs()

    def _block_ids(self, out: SchedulerOutput) -> list[list[int]]:
        return [self.kv_cache.get_block_ids(s.request.request_id) for s in out.scheduled]

    def _run_step(self, out: SchedulerOutput) -> None:
        """Forward, sample, read back and process one step (with speculation: verify, then propose)."""
        with self._watch_workers():
            result = (self.spec or self.runner).execute(out, self._block_ids(out))
        for req, logprobs in result.prompt_logprobs:
            req.prompt_logprobs += logprobs
        sampled_reqs = [s.request for s in out.scheduled if s.samples]
        if isinstance(result, VerifyOutput):
            self._process_verified(out, sampled_reqs, result)
        else:
            self.scheduler.update_from_output(out, {r.request_id: t for r, t in zip(sampled_reqs, result.token_ids)})
            now = time.monotonic()
            for req, lp in zip(sampled_reqs, result.logprobs):
                self._process_token(req, lp, now)
        if self.spec is not None:
            self.spec.propose([r for r in sampled_reqs if not r.is_finished])

    def _can_launch_ahead(self, out: SchedulerOutput) -> bool:
        """Async scheduling, for a step that reads no token value on the host: no speculation (drafts are built
        from the tokens), no penalties or bad words (the sampler reads earlier tokens on the host) and no logprobs, of
        sampled or of prompt tokens (read back with the logits). Under tensor parallelism rank 0 broadcasts the
        sampled tokens on the device."""
        if not self.args.async_scheduling or self.spec is not None:
            return False
        return not any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                       or p.bad_words_token_ids or p.logprobs is not None or s.request.prompt_logprobs_from is not None
                       for s in out.scheduled for p in (s.request.sampling_params,))

    def _read_back_in_flight(self) -> None:
        """Read back the launched step's tokens, put them in place of their placeholders and process them;
        a request that ended meanwhile (aborted, timed out, or stopped by the step before) drops its token."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return
        now = time.monotonic()
        for req, token in zip(step.reqs, self.runner.read_back(step)):
            if not req.has_pending_token:
                continue
            if req.is_finished:
                req.resolve_pending_token(None)
                continue
            req.resolve_pending_token(token)
            self._process_token(req, None, now)

    def _process_verified(self, out: SchedulerOutput, reqs: list[Request], result: VerifyOutput) -> None:
        """A step that verified draft tokens: a request's tokens are judged one at a time, so a stop token, a
        stop string or max_tokens ends it mid-way and drops the rest; then rejected drafts are rolled back."""
        self.scheduler.update_from_output(out, {r.request_id: t[0] for r, t in zip(reqs, result.token_ids)})
        now = time.monotonic()
        for req, tokens, logprobs, num_drafts in zip(reqs, result.token_ids, result.logprobs, result.num_drafts):
            self._process_token(req, logprobs[0], now)
            for token, logprob in zip(tokens[1:], logprobs[1:]):
                if req.is_finished:
                    break
                req.append_token(token)
                self._process_token(req, logprob, now)
            if num_drafts and not req.is_finished:
                self.scheduler.rollback_rejected(req)

    def _process_token(self, req: Request, logprob: Any, now: float) -> None:
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.num_generated += 1
        self.num_generation_tokens += 1
        if req.logprobs is not None and logprob is not None:
            req.logprobs.append(logprob)
        group = self.child_to_group[req.request_id]
        stop = check_stop(req, self.eos_token_ids, self.max_model_len)
        p = req.sampling_params
        stop_token = stop is not None and stop[0] is RequestStatus.FINISHED_STOPPED  # EOS or a stop_token_ids one
        if group.detokenizers and (not stop_token or p.include_stop_str_in_output):  # its text is no output (vLLM)
            detok = group.detokenizers[req.index]
            before = len(req.output_text)
            detok.append(1)
            # stop strings count from min_tokens on, as stop tokens do
            hit = detok.check_stop_string(len(req.output_text) - before) if req.num_output_tokens >= p.min_tokens \
                else None
            if hit is not None:
                stop = (RequestStatus.FINISHED_STOPPED, hit)
        if stop is not None:
            self.scheduler.finish_request(req, stop[0], stop[1])
            self.runner.sampler.forget(req.request_id)
            m.finished_time = now
        self._pending[id(group)] = group

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for group in self._pending.values():
            rid = group.request_id
            finished = all(c.is_finished for c in group.children)
            if not finished and group.children[0].sampling_params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            completions = []
            for i, c in enumerate(group.children):
                text = group.detokenizers[i].streamable_text() if group.detokenizers else ""
                delta_text = text[c.sent_text_len:]
                c.sent_text_len = len(text)
                delta_ids = c.output_token_ids[c.sent_token_len:]
                c.sent_token_len = c.num_output_tokens
                completions.append(CompletionOutput(
                    index=i, text=text, token_ids=c.output_token_ids,
                    finish_reason=c.status.value if c.is_finished else None, stop_reason=c.stop_reason,
                    logprobs=c.logprobs, delta_text=delta_text, delta_token_ids=delta_ids))
            first = group.children[0]
            outputs.append(RequestOutput(rid, group.prompt, group.prompt_token_ids, completions, finished,
                                         first.metrics, first.num_cached_tokens, error=first.error,
                                         prompt_logprobs=first.prompt_logprobs))
            if finished and self.groups.get(rid) is group:  # an aborted group is gone already
                del self.groups[rid]
                for c in group.children:
                    del self.child_to_group[c.request_id]
        self._pending = {}
        return outputs

    def _record_step(self, out: SchedulerOutput, elapsed: float) -> None:
        s = self.last_step
        s.num_prefill_tokens, s.num_decode_tokens = out.num_prefill_tokens, out.num_decode_tokens
        s.num_prefill_reqs, s.num_decode_reqs = out.num_prefill_reqs, out.num_decode_reqs
        s.step_time = elapsed

    def _filled_slots(self) -> int:
        """KV slots of running requests that hold a computed token; a block shared by several counts once."""
        bs, fill = self.kv_cache.block_size, {}
        for r in self.scheduler.running:
            for i, b in enumerate(self.kv_cache.get_block_ids(r.request_id)):
                fill[b] = max(fill.get(b, 0), min(bs, r.num_computed_tokens - i * bs))
        return sum(v for v in fill.values() if v > 0)

    def get_stats(self) -> dict[str, Any]:
        kv, sch = self.kv_cache, self.scheduler
        return {
            "num_running": len(sch.running),
            "num_waiting": len(sch.waiting),
            "num_preempted_waiting": sum(1 for r in sch.waiting if r.status == RequestStatus.PREEMPTED),
            "num_blocks_total": kv.usable_blocks,
            "num_blocks_free": kv.num_free_blocks,
            "num_blocks_cached": kv.pool.num_cached_free_blocks,
            "block_size": kv.block_size,
            "kv_cache_usage": kv.usage,
            "kv_cache_used_tokens": (kv.usable_blocks - kv.num_free_blocks) * kv.block_size,
            "kv_cache_filled_slots": self._filled_slots(),
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "num_preemptions": sch.stats.num_preemptions,
            "num_aborts": sch.stats.num_aborts,
            "num_timeouts": sch.stats.num_timeouts,
            "num_rejected": sch.stats.num_rejected,
            "prompt_tokens_total": self.num_prompt_tokens,
            "generation_tokens_total": self.num_generation_tokens,
            "last_step_prefill_tokens": self.last_step.num_prefill_tokens,
            "last_step_decode_tokens": self.last_step.num_decode_tokens,
            "last_step_prefill_reqs": self.last_step.num_prefill_reqs,
            "last_step_decode_reqs": self.last_step.num_decode_reqs,
            "last_step_time_s": self.last_step.step_time,
            **(self.spec.get_stats() if self.spec is not None else SpecStats().as_dict()),
        }
