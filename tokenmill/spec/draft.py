"""Draft-model proposer: a model sharing the target's vocabulary (a small sibling, or the target itself
quantized: `draft:self@int4`) runs k steps ahead of each request.

KV: the draft's K/V live in a second tensor with the target's block ids. Block b of the pool holds, for the
same block_size tokens, the target's K/V in one tensor and the draft's in the other; a request's block table
serves both models. So the draft needs no blocks, tables or accounting of its own: the pool is sized for
target + draft bytes per token (ModelRunner's extra_kv_bytes_per_token), preemption, prefix sharing and the
rollback of rejected drafts cover both at once. Slots the draft writes ahead of the target (the newest token
and the drafts) are reserved without a prefix hash; K/V of rejected drafts are dropped with the target's.
Per request the draft remembers how many tokens it has computed; after a verification the drafts it fed
that were accepted stay computed, so each step the draft catches up one or two tokens, then drafts.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from tokenmill.config import EngineArgs, ModelConfig, parse_draft
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.scheduler import ScheduledRequest, SchedulerOutput
from tokenmill.model.loader import load_model, load_model_config
from tokenmill.quant.kv_cache import kv_cache_torch_dtype
from tokenmill.request import Request
from tokenmill.runner.model_runner import ModelRunner, kv_bytes_per_token
from tokenmill.runner.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.view import DraftedView

DRAFT_SEED_SALT = 0x5EED_D4AF7   # draft sampling must not reuse the target's random streams


@dataclass
class DraftModel:
    model: torch.nn.Module
    config: ModelConfig
    kv_bytes_per_token: int


def load_draft(args: EngineArgs, target_path: str | None, device: torch.device, dtype: torch.dtype) -> DraftModel:
    """Load the draft named by args.speculative, on the target's device and dtype."""
    name, quant = parse_draft(args.speculative)
    if name == "self":
        path, load_format, preset = target_path, args.load_format, args.model_preset
    else:
        path, load_format, preset = name, "auto", None
    config = load_model_config(path, load_format, preset)
    model = load_model(config, path, load_format, dtype, device, seed=args.seed, quantization=quant,
                       fold_norms=True, quantize_lm_head=args.quantize_lm_head and quant not in (None, "gguf"))
    kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, dtype)
    return DraftModel(model, config, kv_bytes_per_token(config, kv_dtype))


@dataclass
class _DraftState:
    num_preemptions: int
    params: SamplingParams
    num_computed: int = 0                        # tokens with draft K/V, from position 0
    fed: list[int] = field(default_factory=list)  # drafts written past num_computed last time


class DraftProposer:
    def __init__(self, draft: DraftModel, args: EngineArgs, kv_cache: KVCacheManager, num_blocks: int,
                 target_vocab: int, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 eos_token_ids: list[int]) -> None:
        runner_args = dataclasses.replace(args.without_speculation(), num_gpu_blocks_override=num_blocks,
                                          kv_cache_tokens=None, kv_cache_memory=None)  # the target's block count
        self.runner = ModelRunner(draft.model, draft.config, runner_args, device, dtype, max_model_len, eos_token_ids)
        self.kv_cache = kv_cache
        self.target_vocab = target_vocab
        self.sampler = Sampler(min(draft.config.vocab_size, target_vocab), eos_token_ids, device,
                               args.seed ^ DRAFT_SEED_SALT)
        self.states: dict[str, _DraftState] = {}
        self.one_off_seconds = 0.0   # of the last proposal: catching up on a long stretch (a new prompt)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.sampler.forget(request_id)

    def _state(self, req: Request) -> _DraftState:
        st = self.states.get(req.request_id)
        if st is None or st.num_preemptions != req.num_preemptions:  # new, or its blocks were dropped
            p = req.sampling_params
            params = p if p.seed is None else dataclasses.replace(p, seed=(p.seed ^ DRAFT_SEED_SALT) % 2 ** 63)
            st = self.states[req.request_id] = _DraftState(req.num_preemptions, params)
            return st
        came = req.all_token_ids[st.num_computed: st.num_computed + len(st.fed)]
        matched = 0
        while matched < len(came) and came[matched] == st.fed[matched]:
            matched += 1
        st.num_computed = min(st.num_computed + matched, req.num_computed_tokens)
        st.fed = []
        return st

    @torch.inference_mode()
    def propose(self, reqs: list[Request], num_tokens: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        live = [i for i, (r, k) in enumerate(zip(reqs, num_tokens))
                if k > 0 and self.kv_cache.reserve_slots(r, r.num_tokens + k - 1, keep_free=len(reqs))]
        states = {i: self._state(reqs[i]) for i in live}
        # catch up on the confirmed tokens, then one token per step
        sched = [ScheduledRequest(DraftedView(reqs[i], [], st.num_computed), reqs[i].num_tokens - st.num_computed)
                 for i, st in states.items()]
        catch_up = sum(s.num_new_tokens for s in sched)
        step, t0 = 0, time.perf_counter()
        self.one_off_seconds = 0.0
        while live:
            block_ids = [self.kv_cache.get_block_ids(reqs[i].request_id) for i in live]
            logits = self.runner.compute_logits(SchedulerOutput(sched), block_ids)
            views = [DraftedView(reqs[i], drafts[i], sampling_params=states[i].params) for i in live]
            tokens, q = self._sample(logits, views)
            for j, i in enumerate(live):
                drafts[i].append(tokens[j])
                if q[j] is not None:
                    probs[i].append(q[j])
            if step == 0 and catch_up > 2 * len(sched):
                self.one_off_seconds = time.perf_counter() - t0
            step += 1
            live = [i for i in live if step < num_tokens[i]]
            sched = [ScheduledRequest(DraftedView(reqs[i], drafts[i], reqs[i].num_tokens + step - 1), 1) for i in live]
        for i, st in states.items():
            st.num_computed, st.fed = reqs[i].num_tokens, drafts[i][:-1]
        return drafts, [torch.stack(p) if p else None for p in probs]

    def _sample(self, logits: torch.Tensor, views: list[DraftedView]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Greedy requests get the draft's argmax (a point mass); the others a sample from q, the draft's
        distribution under the request's own sampling parameters, which the rejection rule needs."""
        logits, _ = self.sampler.process(logits, views)
        tokens = logits.argmax(dim=-1).tolist()
        q: list[torch.Tensor | None] = [None] * len(views)
        rows = [j for j, v in enumerate(views) if not v.sampling_params.greedy]
        if rows:
            p = self.sampler.probs(logits[rows], [views[j].sampling_params for j in rows])
            if p.shape[1] < self.target_vocab:
                p = torch.nn.functional.pad(p, (0, self.target_vocab - p.shape[1]))
            sampled = self.sampler.race(p, [views[j] for j in rows]).tolist()
            for n, j in enumerate(rows):
                tokens[j], q[j] = sampled[n], p[n]
        return tokens, q
