"""Speculative decoding through the whole engine on a tiny random model: greedy output identical to plain
decoding for many prompts, batch sizes, K and proposers; KV invariants after every step of random runs with
rejections, aborts, preemptions and prefix caching; logprobs, stop conditions and seeds."""
import random

import pytest

from tokenmill import LLM, SamplingParams

TINY = dict(load_format="dummy", model_preset="tiny-llama", dtype="float32", max_model_len=512,
            kv_cache_memory=32 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Random token ids, half of them with a repeated span so n-gram lookup finds matches."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(3, 256) for _ in range(rng.randrange(4, 30))]
        out.append(p * 2 if i % 2 else p)
    return out


def make(spec=None, k=4, adaptive=False, **kw) -> LLM:
    llm = LLM(**{**TINY, **kw}, speculative=spec, num_speculative_tokens=k)
    if spec is not None:
        llm.llm_engine.spec.adaptive = adaptive
    return llm


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference():
    return token_ids(make().generate(prompts(12), GREEDY))


@pytest.mark.parametrize("spec,k,batch,kw", [
    ("ngram", 1, 1, {}),
    ("ngram", 3, 4, {}),
    ("ngram", 6, 12, dict(block_size=4)),
    ("ngram", 4, 4, dict(max_num_batched_tokens=6)),   # drafts cut by the token budget, chunked prefill
    ("draft:self", 2, 3, {}),
    ("draft:self", 5, 12, dict(block_size=8)),
    ("draft:self@int4", 4, 6, {}),
    ("draft:self", 3, 4, dict(kv_cache_tokens=2048, kv_cache_memory=None)),  # the draft takes the target's blocks
])
def test_greedy_identical_to_plain_decoding(reference, spec, k, batch, kw):
    llm = make(spec, k, **kw)
    ps = prompts(12)
    got = []
    for i in range(0, len(ps), batch):
        got += token_ids(llm.generate(ps[i:i + batch], GREEDY))
    assert got == reference
    stats = llm.llm_engine.get_stats()
    assert 0 < stats["spec_num_accepted_tokens"] <= stats["spec_num_draft_tokens"]
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    llm.llm_engine.kv_cache.check_invariants()


@pytest.mark.parametrize("spec", ["ngram", "draft:self"])
def test_random_run_with_aborts_and_preemptions(reference, spec):
    """Invariants after every step; finished requests match plain decoding, aborted ones are a prefix of it."""
    from tokenmill.runner.model_runner import kv_bytes_per_token
    llm = make()
    per_token = kv_bytes_per_token(llm.llm_engine.model_config, llm.llm_engine.dtype)
    llm = make(spec, 4, block_size=4, kv_cache_memory=per_token * 4 * 40 * (2 if spec != "ngram" else 1))
    engine, rng = llm.llm_engine, random.Random(1)
    ps, added, outputs, aborted = prompts(12), 0, {}, set()
    while added < len(ps) or engine.has_unfinished_requests():
        if added < len(ps) and rng.random() < 0.5:
            engine.add_request(str(added), ps[added], GREEDY)
            added += 1
        for o in engine.step():
            outputs[o.request_id] = o.outputs[0].token_ids
        engine.kv_cache.check_invariants()
        running = [r for r in engine.scheduler.running if r.num_output_tokens > 2]
        if running and rng.random() < 0.04:
            victim = rng.choice(running).request_id
            engine.abort_request(victim)
            aborted.add(victim)
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0 and aborted
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    for i, ref in enumerate(reference):
        got = outputs[str(i)]
        assert got == ref[: len(got)] if str(i) in aborted else got == ref


def test_logprobs_and_stop_conditions_match_plain_decoding():
    ps = prompts(6, seed=3)
    plain = make().generate(ps, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2))
    stops = [o.outputs[0].token_ids[i + 5] for i, o in enumerate(plain)]   # a token met mid-way
    params = [SamplingParams(temperature=0, max_tokens=30 - i, ignore_eos=True, logprobs=2, stop_token_ids=[s])
              for i, s in enumerate(stops)]
    want = make().generate(ps, params)
    got = make("ngram", 5).generate(ps, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason == "stop"
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.token_id == lg.token_id and lw.logprob == pytest.approx(lg.logprob, abs=1e-4)
            assert set(lw.top) == set(lg.top)
    short = make("ngram", 5).generate(ps, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 3 and o.outputs[0].finish_reason == "length" for o in short)


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    ps = prompts(6, seed=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=30, ignore_eos=True)
    alone = token_ids(make("ngram", 3, prompt_lookup_min=1).generate(ps[1:2], params))[0]
    llm = make("ngram", 3, prompt_lookup_min=1)
    batched = llm.generate(ps, [params if i == 1 else SamplingParams(temperature=1.0, max_tokens=20) for i in range(6)])
    assert batched[1].outputs[0].token_ids == alone
    assert llm.llm_engine.get_stats()["spec_num_verifications"] > 0


def test_seeded_sampling_does_not_depend_on_the_number_of_drafts():
    """The adaptive rule picks k from measured step times, so a seeded request must give the same tokens whatever
    k it was allowed: with n-gram drafts they are plain seeded decoding's (they used to change with k, hence
    from run to run)."""
    ps = prompts(4, seed=6)
    params = SamplingParams(temperature=0.5, top_k=3, seed=5, max_tokens=30, ignore_eos=True)
    want = token_ids(make().generate(ps, params))
    for k in (1, 4):
        llm = make("ngram", k, prompt_lookup_min=1)
        assert token_ids(llm.generate(ps, params)) == want
        assert llm.llm_engine.get_stats()["spec_num_accepted_tokens"] > 0


def test_logit_bias_applies_to_verification_and_drafts():
    """Greedy with logit_bias under speculation is plain decoding with that bias: the target's verification
    applies it, and so does the draft model (else its drafts, the unbiased argmax, would mostly be rejected)."""
    ps = prompts(6, seed=5)
    rng = random.Random(5)
    bias = {t: rng.choice((-4.0, 4.0)) for t in rng.sample(range(3, 256), 40)}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias=bias)
    plain = make()
    want = token_ids(plain.generate(ps, params))
    assert all(w != u for w, u in zip(want, token_ids(plain.generate(ps, GREEDY))))
    for spec in ("ngram", "draft:self"):
        llm = make(spec, 4)
        assert token_ids(llm.generate(ps, params)) == want
        stats = llm.llm_engine.get_stats()
        floor = 0.9 if spec == "draft:self" else 0.0  # same weights, same bias: the draft's argmax is the target's
        assert stats["spec_num_accepted_tokens"] > floor * stats["spec_num_draft_tokens"]
