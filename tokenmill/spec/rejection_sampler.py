"""Verification of draft tokens: the standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023).

Draft token x at a position is accepted with probability min(1, p(x) / q(x)), p the target's distribution there
(after penalties, temperature, top-k / top-p / min-p, exactly as the plain sampler builds it) and q the
proposer's (a point mass for n-gram lookup and greedy drafts). At the first rejection one token is drawn from
the normalized residual max(0, p - q) and the step ends; when every draft is accepted a bonus token is drawn
from p at the position after the last one. Each emitted token is then distributed exactly as the target's.
A greedy request's p is the one-hot of its argmax, which turns the rule into "accept while the draft equals
the argmax, then emit the argmax": the output of plain greedy decoding, token for token. A seeded request with
point-mass drafts races them against the token plain decoding would draw (_race_drafts): the same rule, with
random draws that do not depend on how many drafts it carried.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.outputs import Logprob
from tokenmill.request import Request
from tokenmill.runner.sampler import Sampler
from tokenmill.spec.view import DraftedView


@dataclass
class VerifyOutput:
    """Per sampled request of the step: the emitted tokens (accepted drafts, then one resampled or bonus token)
    and their logprobs, and how many drafts it carried."""

    token_ids: list[list[int]]
    logprobs: list[list[Logprob | None]]
    num_drafts: list[int]
    prompt_logprobs: list[tuple[Request, list[Logprob]]] = field(default_factory=list)  # the runner's, this step


def accept(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept a draft x with probability min(1, p(x) / q(x)), u ~ U[0, 1)."""
    return u * q_draft < p_draft


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a rejected position draws from: max(0, p - q) (the sampler needs no normalization). It is zero
    only when p <= q everywhere, i.e. acceptance was certain and a rejection came from rounding: then p."""
    r = (p - q).clamp_min(0.0)
    return torch.where(r.sum(dim=-1, keepdim=True) > 0, r, p)


def emitted_counts(accepted: list[bool], num_drafts: list[int]) -> list[int]:
    """Accepted drafts per request: the leading run of accepted flags among its own."""
    out, i = [], 0
    for k in num_drafts:
        a = 0
        while a < k and accepted[i + a]:
            a += 1
        out.append(a)
        i += k
    return out


@dataclass
class RejectionSampler:
    """Verifies the draft rows of a step with the target's own Sampler (same processing, same generators)."""

    sampler: Sampler
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)   # request id -> q [k, vocab]

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> VerifyOutput:
        """logits: for each request in order, one row per draft token and one after the last, [rows, vocab]."""
        num_drafts = [len(r.spec_token_ids) for r in reqs]
        views = [DraftedView(r, r.spec_token_ids[:j]) for r, k in zip(reqs, num_drafts) for j in range(k + 1)]
        logits, raw_logprobs = self.sampler.process(logits, views)
        p = self._target_probs(logits, views)
        starts = [0]
        for k in num_drafts:
            starts.append(starts[-1] + k + 1)
        dev = p.device
        draft_rows = [s + j for s, k in zip(starts, num_drafts) for j in range(k)]
        draft_ids = torch.tensor([t for r in reqs for t in r.spec_token_ids], dtype=torch.long, device=dev)
        p_draft = p[torch.tensor(draft_rows, device=dev), draft_ids]
        q_draft = self._q_draft(reqs, num_drafts, draft_ids)
        raced = {i: self._race_drafts(logits[s: s + k + 1], r)
                 for i, (r, s, k) in enumerate(zip(reqs, starts, num_drafts)) if self._races(r)}
        u = self._uniforms(reqs, num_drafts, dev)
        num_accepted = emitted_counts(accept(p_draft, q_draft, u).tolist(), num_drafts)
        for i, t in raced.items():
            num_accepted[i] = len(t) - 1
        final_rows = [s + a for s, a in zip(starts, num_accepted)]
        final = p[torch.tensor(final_rows, device=dev)]
        rejected = [i for i, (a, k) in enumerate(zip(num_accepted, num_drafts)) if a < k and i not in raced]
        if rejected:
            q = torch.stack([self._q_row(reqs[i], num_accepted[i], final.shape[1], dev) for i in rejected])
            final[rejected] = residual(final[rejected], q)
        ruled = [i for i in range(len(reqs)) if i not in raced]   # judged with u and the residual
        drawn = self.sampler.race(final[ruled], [reqs[i] for i in ruled]).tolist() if ruled else []
        last = dict(zip(ruled, drawn))
        tokens = [raced[i] if i in raced else r.spec_token_ids[:a] + [last[i]]
                  for i, (r, a) in enumerate(zip(reqs, num_accepted))]
        logprobs = [[None] * len(t) for t in tokens]
        if raw_logprobs is not None:
            for i, (r, t) in enumerate(zip(reqs, tokens)):
                rows = range(starts[i], starts[i] + len(t))
                logprobs[i] = Sampler.logprobs(raw_logprobs[list(rows)], t, [r] * len(t))
        for r in reqs:
            self.draft_probs.pop(r.request_id, None)
        return VerifyOutput(tokens, logprobs, num_drafts)

    def _target_probs(self, logits: torch.Tensor, views: list[DraftedView]) -> torch.Tensor:
        """p for every row: the plain sampler's distribution; the one-hot of the argmax for greedy rows."""
        params = [v.sampling_params for v in views]
        greedy = [i for i, sp in enumerate(params) if sp.greedy]
        if len(greedy) == len(views):
            return torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        p = self.sampler.probs(logits, params)
        if greedy:
            g = torch.tensor(greedy, device=logits.device)
            p[g] = torch.zeros_like(p[g]).scatter_(1, logits[g].argmax(dim=-1, keepdim=True), 1.0)
        return p

    def _races(self, req: Request) -> bool:
        """A seeded, sampled request with point-mass (n-gram) drafts: judged by _race_drafts."""
        p = req.sampling_params
        return p.seed is not None and not p.greedy and req.request_id not in self.draft_probs

    def _race_drafts(self, logits: torch.Tensor, req: Request) -> list[int]:
        """The emitted tokens of a request that _races: at each position the token plain decoding would draw
        (Sampler.draw on that row of processed logits: one Exp(1) row from the request's generator), the draft
        accepted while it is that token. For a point-mass q this is the rule (x kept with probability p(x), else a
        token from p without x: the normalized residual), and it draws one row per emitted token however many
        drafts there were, so a seeded request's tokens do not depend on the k that the adaptive rule (which
        follows measured step times) or the token budget allowed: they are those of plain seeded decoding."""
        drafts, out = req.spec_token_ids, []
        for j in range(logits.shape[0]):
            out.append(int(self.sampler.draw(logits[j: j + 1], [req])[0]))
            if j == len(drafts) or out[-1] != drafts[j]:
                break
        return out

    def _q_draft(self, reqs: list[Request], num_drafts: list[int], draft_ids: torch.Tensor) -> torch.Tensor:
        """q of each draft token: from the proposer's distribution where it gave one, else 1 (a point mass)."""
        q_draft = torch.ones(len(draft_ids), device=draft_ids.device)
        offsets, with_q = 0, []
        for r, k in zip(reqs, num_drafts):
            if k and r.request_id in self.draft_probs:
                with_q.append((offsets, k, self.draft_probs[r.request_id]))
            offsets += k
        if with_q:
            dev = draft_ids.device
            idx = torch.tensor([o + j for o, k, _ in with_q for j in range(k)], device=dev)
            rows = torch.cat([q[:k].to(dev) for _, k, q in with_q])
            q_draft[idx] = rows.gather(1, draft_ids[idx, None])[:, 0]
        return q_draft

    def _q_row(self, req: Request, j: int, vocab: int, dev: torch.device) -> torch.Tensor:
        """q at draft position j: the proposer's distribution, or the point mass on the draft token."""
        if req.request_id in self.draft_probs:
            return self.draft_probs[req.request_id][j].to(dev)
        return torch.zeros(vocab, device=dev).index_fill_(0, torch.tensor([req.spec_token_ids[j]], device=dev), 1.0)

    def _uniforms(self, reqs: list[Request], num_drafts: list[int], dev: torch.device) -> torch.Tensor:
        """One U[0, 1) per draft token, a seeded request's from its own generator (0 for a raced request's)."""
        u = torch.zeros(sum(num_drafts), device=dev)
        unseeded, i = [], 0
        for r, k in zip(reqs, num_drafts):
            if r.sampling_params.seed is None:
                unseeded.extend(range(i, i + k))
            elif k and not self._races(r):   # a raced request draws no u
                u[i: i + k] = torch.rand(k, device=dev, generator=self.sampler.request_generator(r))
            i += k
        if unseeded:
            u[torch.tensor(unseeded, device=dev)] = torch.rand(len(unseeded), device=dev,
                                                                generator=self.sampler.generator)
        return u
