"""The rejection sampler on synthetic target / draft distributions over a tiny vocabulary: emitted tokens follow
the target exactly (chi-square with a fixed seed), deliberately broken rules are caught, greedy rows follow the
argmax, and each draft position is scored with the drafts before it in context."""
import math

import pytest
import torch

from tokenmill.request import Request
from tokenmill.runner.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec import rejection_sampler as rs
from tokenmill.spec.view import DraftedView

V, K = 6, 3
BATCH, ROUNDS = 4000, 3
CHI2_999 = {2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5}   # chi-square quantiles at p = 0.999 by degrees of freedom


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over the cells with some expected mass; degrees of freedom."""
    n = counts.sum()
    keep = probs > 1e-9
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    exp = n * probs[keep]
    return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


def target_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """What the plain sampler draws from, computed independently of it."""
    scaled = logits / temperature
    kth = scaled.topk(top_k, dim=-1).values[..., -1:]
    return torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)


def run(params: SamplingParams, with_q: bool, seed: int = 0, seeded: bool = False):
    """Many one-step verifications of K drafts: first and second emitted tokens, accepted counts."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(K + 1, V, generator=gen) * 1.5
    q = torch.softmax(torch.randn(K, V, generator=gen) * 1.5, dim=-1)
    sampler = Sampler(V, [], torch.device("cpu"), seed)
    rsampler = rs.RejectionSampler(sampler)
    first, second, accepted = torch.zeros(V), torch.zeros(V), torch.zeros(K + 1)
    for round_ in range(ROUNDS):
        reqs = []
        point = torch.multinomial(q, BATCH, replacement=True, generator=gen).T   # [BATCH, K] drafts from q
        for i in range(BATCH):
            if seeded:   # each request its own generator: seed, then the rule's draws, from it alone
                params = SamplingParams(temperature=params.temperature, top_k=params.top_k, seed=round_ * BATCH + i)
            r = Request(f"r{round_}-{i}", [0], params)
            r.spec_token_ids = point[i].tolist()
            if with_q:
                rsampler.draft_probs[r.request_id] = q
            reqs.append(r)
        out = rsampler(logits.repeat(BATCH, 1), reqs)
        for tokens in out.token_ids:
            first[tokens[0]] += 1
            if len(tokens) > 1:
                second[tokens[1]] += 1
            accepted[len(tokens) - 1] += 1
    return logits, q, first, second, accepted


def expected_accepted(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(a drafts accepted) when position j accepts with probability beta_j = sum min(p_j, q_j)."""
    beta = torch.minimum(p[:K], q).sum(-1)
    out, alive = torch.zeros(K + 1), 1.0
    for j in range(K):
        out[j] = alive * (1 - beta[j])
        alive *= beta[j]
    out[K] = alive
    return out


@pytest.mark.parametrize("params,seeded", [(SamplingParams(temperature=1.0), False),
                                           (SamplingParams(temperature=0.7, top_k=4), False),
                                           (SamplingParams(temperature=1.3), True)])
def test_emitted_tokens_follow_the_target(params, seeded):
    logits, q, first, second, accepted = run(params, with_q=True, seeded=seeded)
    p = target_probs(logits, params.temperature, params.top_k if params.top_k > 0 else V)
    for counts, probs in ((first, p[0]), (second, p[1])):
        stat, dof = chi2(counts, probs)
        assert stat < CHI2_999[dof], (stat, dof)
    stat, dof = chi2(accepted, expected_accepted(p, q))
    assert stat < CHI2_999[dof], (stat, dof)


@pytest.mark.parametrize("seeded", [False, True])
def test_point_mass_drafts_follow_the_target(seeded):
    """n-gram drafts carry no q: they are point masses, accepted with probability p(x) (seeded requests by a race
    against the token plain decoding draws)."""
    params = SamplingParams(temperature=0.9)
    logits, _, first, second, _ = run(params, with_q=False, seeded=seeded)
    p = target_probs(logits, 0.9, V)
    for counts, probs in ((first, p[0]), (second, p[1])):
        stat, dof = chi2(counts, probs)
        assert stat < CHI2_999[dof], (stat, dof)


@pytest.mark.parametrize("broken", ["residual_is_target", "accept_ignores_q"])
def test_broken_rules_are_detected(monkeypatch, broken):
    if broken == "residual_is_target":    # resample from p instead of max(0, p - q): p's mass counted twice
        monkeypatch.setattr(rs, "residual", lambda p, q: p)
    else:                                  # accept with p(x) instead of min(1, p(x) / q(x))
        monkeypatch.setattr(rs, "accept", lambda p_draft, q_draft, u: u < p_draft)
    logits, _, first, _, _ = run(SamplingParams(temperature=1.0), with_q=True)
    p = target_probs(logits, 1.0, V)
    stat, dof = chi2(first, p[0])
    assert stat > 10 * CHI2_999[dof], stat


def test_greedy_accepts_while_draft_is_argmax():
    logits = torch.tensor([[0.0, 3, 1, 0, 0, 0], [0, 0, 0, 5, 0, 0], [4, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 2]])
    sampler = Sampler(V, [], torch.device("cpu"), 0)
    r1 = Request("a", [0], SamplingParams(temperature=0))
    r1.spec_token_ids = [1, 3, 2]             # third draft is wrong: the argmax 0 comes instead
    r2 = Request("b", [0], SamplingParams(temperature=0))
    r2.spec_token_ids = [1, 3, 0]             # all right: bonus token 5
    r3 = Request("c", [0], SamplingParams(temperature=0))   # no drafts in the same batch
    out = rs.RejectionSampler(sampler)(torch.cat([logits, logits, logits[:1]]), [r1, r2, r3])
    assert out.token_ids == [[1, 3, 0], [1, 3, 0, 5], [1]]
    assert out.num_drafts == [3, 3, 0]


def test_draft_positions_are_scored_with_earlier_drafts_in_context():
    """Penalties and min_tokens at draft position j see the j drafts before it, as plain decoding would."""
    params = SamplingParams(temperature=1.0, repetition_penalty=1.7, frequency_penalty=0.4, min_tokens=3)
    sampler = Sampler(V, [5], torch.device("cpu"), 0)
    req = Request("a", [1, 2], params)
    req.append_token(3)
    drafts = [4, 1, 4]
    logits = torch.randn(len(drafts) + 1, V)
    views = [DraftedView(req, drafts[:j]) for j in range(len(drafts) + 1)]
    got, _ = sampler.process(logits.clone(), views)
    for j in range(len(drafts) + 1):
        plain = Request("b", [1, 2], params)
        for t in [3] + drafts[:j]:
            plain.append_token(t)
        want, _ = sampler.process(logits[j:j + 1].clone(), [plain])
        assert torch.allclose(got[j], want[0])
        assert math.isinf(float(got[j, 5])) == (plain.num_output_tokens < 3)
