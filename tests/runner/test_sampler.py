import math

import pytest
import torch

from tokenmill.request import Request
from tokenmill.runner.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.view import DraftedView


def req(i, **kw):
    return Request(f"r{i}", [1, 2, 3], SamplingParams(**kw))


def make(vocab=8):
    return Sampler(vocab, eos_token_ids=[0], device=torch.device("cpu"), seed=0)


def test_greedy_and_top_k_1_pick_argmax():
    logits = torch.randn(3, 8)
    out = make()(logits.clone(), [req(0, temperature=0), req(1, top_k=1), req(2, temperature=0)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    """A top_k past int64 (the API does not bound it) means all tokens, as in vLLM, not an overflow."""
    logits = torch.randn(2, 8)
    params = dict(temperature=1.0, top_p=0.9, seed=5)
    huge = make()(logits.clone(), [req(0, top_k=10 ** 20, **params), req(1, top_k=8, **params)]).token_ids
    assert huge == make()(logits.clone(), [req(0, top_k=8, **params), req(1, top_k=8, **params)]).token_ids


def test_seeded_request_same_tokens_whatever_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(1, 8).repeat(5, 1)
    s1, s2 = make(), make()
    alone = [s1(logits[:1].clone(), [req(0, temperature=1.0, seed=42)]).token_ids[0] for _ in range(20)]
    batched = []
    for _ in range(20):
        reqs = [req(1, temperature=1.0), req(0, temperature=1.0, seed=42), req(2, temperature=0.5)]
        batched.append(s2(logits[:3].clone(), reqs).token_ids[1])
    assert alone == batched


def test_sampling_follows_softmax_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -9, -9, -9]])
    s = make()
    n = 6000
    counts = torch.zeros(8)
    for _ in range(n // 200):
        out = s(logits.repeat(200, 1), [req(i, temperature=0.7) for i in range(200)])
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=8)
    p = torch.softmax(logits[0] / 0.7, -1)
    chi2 = float((((counts - n * p) ** 2) / (n * p).clamp_min(1e-9))[:5].sum())
    assert chi2 < 20.5  # 4 degrees of freedom, p = 0.0004


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.3, top_k=3), dict(top_p=0.6),
                                    dict(temperature=0.5, min_p=0.2)], ids=["temperature", "top_k", "top_p", "min_p"])
def test_draw_picks_the_token_the_race_over_probs_picks(params: dict):
    """draw() (the race in log form over the raw logits, the filters applied as a mask) and race() over probs()
    (the softmax of the filtered, scaled logits) turn the same Exp(1) draws into the same tokens."""
    torch.manual_seed(3)
    logits = torch.randn(64, 8) * 2
    reqs = [req(i, seed=i, **params) for i in range(64)]
    s1, s2 = make(), make()
    for _ in range(5):
        drawn = s1.draw(logits, reqs).tolist()
        raced = s2.race(s2.probs(logits, [r.sampling_params for r in reqs]), reqs).tolist()
        assert drawn == raced


def test_top_p_and_min_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0]]) + 1e-12)
    s = make()
    toks = set(s(logits.repeat(500, 1), [req(i, top_p=0.75) for i in range(500)]).token_ids)
    assert toks == {0, 1}
    toks = set(s(logits.repeat(500, 1), [req(i, min_p=0.3) for i in range(500)]).token_ids)
    assert toks == {0, 1}
    toks = set(s(logits.repeat(500, 1), [req(i, top_k=3) for i in range(500)]).token_ids)
    assert toks == {0, 1, 2}


def test_penalties_and_min_tokens():
    s = make()
    logits = torch.tensor([[5.0, 4.9, 0, 0, 0, 0, 0, 0]])
    r = req(0, temperature=0, min_tokens=2)
    assert s(logits.clone(), [r]).token_ids == [1]  # eos (0) suppressed before min_tokens
    r = Request("x", [1], SamplingParams(temperature=0, repetition_penalty=2.0))
    assert s(torch.tensor([[0.0, 4.0, 3.0, 0, 0, 0, 0, 0]]), [r]).token_ids == [2]
    r = Request("y", [5], SamplingParams(temperature=0, frequency_penalty=2.0))
    r.append_token(1)
    r.append_token(1)
    assert s(torch.tensor([[0.0, 4.0, 3.0, 0, 0, 0, 0, 0]]), [r]).token_ids == [2]


def test_logit_bias_is_added_to_the_rows_that_have_it():
    """A batch of rows with and without logit_bias: each biased entry moves by its bias, nothing else moves."""
    torch.manual_seed(0)
    logits = torch.randn(4, 8)
    biases = [None, {3: 100.0}, {1: -2.5, 6: 0.75}, None]
    reqs = [req(i, temperature=0, logit_bias=b) for i, b in enumerate(biases)]
    processed, _ = make().process(logits.clone(), reqs)
    want = logits.clone()
    for i, b in enumerate(biases):
        for t, v in (b or {}).items():
            want[i, t] += v
    assert torch.equal(processed, want)


def test_logit_bias_decides_greedy_and_sampled_tokens():
    """+100 makes greedy and sampling pick a token, -100 bans the argmax; unbiased rows, logprobs (raw, as vLLM's
    default) and ids past the sampler's vocabulary (a smaller draft model's) are untouched."""
    torch.manual_seed(0)
    logits = torch.randn(5, 8)
    top = logits.argmax(-1)
    reqs = [req(0, temperature=0), req(1, temperature=0, logit_bias={3: 100}),
            req(2, temperature=1.0, seed=3, logit_bias={5: 100, 9: -100}), req(3, temperature=1.0, top_k=1),
            req(4, temperature=0, logit_bias={int(top[4]): -100}, logprobs=1)]
    out = make()(logits.clone(), reqs)
    second = logits[4].topk(2).indices[1]
    assert out.token_ids == [int(top[0]), 3, 5, int(top[3]), int(second)]
    assert out.logprobs[4].top == {int(top[4]): pytest.approx(float(torch.log_softmax(logits[4], -1).max()))}


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-30])
def test_the_most_probable_token_survives_any_top_p(top_p):
    """top_p below float32's least positive value became 0 on the device, and `cum >= 0` cut every token: the
    sampler then answered token 0 (EOS here) whatever the logits. The first token always stays (vLLM's)."""
    logits = torch.log(torch.tensor([[0.05, 0.1, 0.6, 0.25, 0, 0, 0, 0]]) + 1e-12)
    out = make()(logits.repeat(50, 1), [req(i, top_p=top_p, seed=i) for i in range(50)])
    assert set(out.token_ids) == {2}


def test_allowed_token_ids_are_the_only_tokens_drawn():
    """Greedy and sampled rows with allowed_token_ids draw only from them, the other rows from the whole vocabulary;
    a draft's smaller vocabulary holding none of them leaves its row as it is."""
    torch.manual_seed(0)
    logits = torch.randn(3, 8)
    logits[:, 7] = 50.0  # the argmax, outside every allowed set
    allowed = [2, 5]
    for _ in range(20):
        reqs = [req(0, temperature=0, allowed_token_ids=allowed), req(1, temperature=1.5, allowed_token_ids=allowed),
                req(2, temperature=0)]
        out = make()(logits.clone(), reqs)
        assert out.token_ids[0] == allowed[int(logits[0, allowed].argmax())]
        assert out.token_ids[1] in allowed and out.token_ids[2] == 7
    processed, _ = make(vocab=4).process(logits[:1, :4].clone(), [req(0, allowed_token_ids=[6])])
    assert torch.equal(processed, logits[:1, :4])


def test_bad_words_mask_a_last_token_after_the_rest():
    """vLLM's bad words: a one-token word is never drawn; a longer word's last token only right after the rest of
    it in the output; a drafted view (speculative verification) counts its drafts as output; ids past a draft
    model's smaller vocabulary are left out."""
    logits = torch.zeros(1, 8)
    logits[0, 4], logits[0, 6], logits[0, 7] = 3.0, 2.0, 1.0
    seqs = [[4], [2, 3, 6], [7, 9]]
    r = Request("b", [1], SamplingParams(temperature=0, bad_words_token_ids=seqs))
    processed, _ = make().process(logits.clone(), [r])
    assert processed[0, 4] == float("-inf") and processed[0, 6] == 2.0 and processed[0, 7] == 1.0
    assert make()(logits.clone(), [r]).token_ids == [6]
    for t in (2, 3):
        r.append_token(t)
    assert make()(logits.clone(), [r]).token_ids == [7]  # 4 banned always, 6 after 2, 3
    r.append_token(5)
    assert make()(logits.clone(), [r]).token_ids == [6]
    drafted = DraftedView(r, [2, 3])
    assert make()(logits.clone(), [drafted]).token_ids == [7]
    processed, _ = make(vocab=4).process(logits[:, :4].clone(), [Request("c", [1], SamplingParams(
        bad_words_token_ids=[[9], [1, 8]]))])
    assert torch.equal(processed, logits[:, :4])


def test_bad_words_that_would_ban_every_allowed_token_are_lifted_for_that_step():
    """Longer bad words whose last tokens cover what allowed_token_ids leaves (with min_tokens, beside EOS) are
    not applied at that step: every logit -inf would answer with a token outside allowed_token_ids (7 here). One
    that leaves an allowed token still applies, and so do one-token words."""
    logits = torch.zeros(1, 8)
    logits[0, 7], logits[0, 5], logits[0, 6] = 9.0, 2.0, 1.0
    for sampled in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        r = Request("a", [1], SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[3, 5], [3, 6]],
                                             **sampled))
        r.append_token(3)
        assert make()(logits.clone(), [r]).token_ids[0] in (5, 6)
        r = Request("b", [1], SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[3, 5], [6]],
                                             **sampled))
        r.append_token(3)
        assert make()(logits.clone(), [r]).token_ids == [5]
    r = Request("c", [1], SamplingParams(temperature=0, allowed_token_ids=[0, 5], min_tokens=3,
                                         bad_words_token_ids=[[3, 5]]))
    r.append_token(3)
    processed, _ = make().process(logits.clone(), [r])
    assert processed[0, 5] == 2.0 and processed[0, 0] == float("-inf")
    r.append_token(3)
    r.append_token(3)  # min_tokens reached: EOS may come, so the word applies again
    processed, _ = make().process(logits.clone(), [r])
    assert processed[0, 5] == float("-inf") and processed[0, 0] == 0.0


def test_logprobs_are_log_softmax_with_top_k():
    logits = torch.randn(1, 8)
    out = make()(logits.clone(), [req(0, temperature=0, logprobs=3)])
    lp = torch.log_softmax(logits[0], -1)
    entry = out.logprobs[0]
    assert entry.token_id == out.token_ids[0]
    assert math.isclose(entry.logprob, float(lp.max()), rel_tol=1e-5)
    assert list(entry.top) == lp.topk(3).indices.tolist()
    assert entry.rank == 1


def test_logprob_rank_of_a_sampled_token():
    """vLLM's rank: 1 + how many tokens the model found more likely than the one drawn."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    sampler = make(vocab=5)
    ranks = set()
    for seed in range(40):
        out = sampler(logits.clone(), [req(seed, temperature=5.0, seed=seed, logprobs=2)])
        entry = out.logprobs[0]
        assert entry.rank == entry.token_id + 1  # the logits fall with the id
        ranks.add(entry.rank)
    assert len(ranks) > 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_on_the_gpu_never_waits_for_the_device(no_device_sync) -> None:
    """Greedy, filtered, seeded, penalized, min_tokens and logit_bias rows in one batch, all queued without a host
    wait."""
    sampler = Sampler(50, eos_token_ids=[0], device=torch.device("cuda"), seed=0)
    reqs = [req(0, temperature=0), req(1, temperature=0.6, top_k=5, top_p=0.9, min_p=0.05),
            req(2, temperature=1.0, seed=7, repetition_penalty=1.2, min_tokens=3),
            req(3, temperature=0, logit_bias={17: 100, 4: -1.5}), req(4, temperature=0.8, allowed_token_ids=[9])]
    tokens, _ = sampler.sample(torch.randn(5, 50, device="cuda"), reqs)
    torch.cuda.set_sync_debug_mode(0)
    assert tokens.shape == (5,) and tokens.min().item() >= 0 and tokens[3].item() == 17 and tokens[4].item() == 9
