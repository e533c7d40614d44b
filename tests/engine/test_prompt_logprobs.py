"""SamplingParams.prompt_logprobs on the real default model: the log-softmax of transformers' logits at every
prompt position, whatever the chunking, batching, block size, prefix cache, preemption, n or speculation."""
import os

import pytest
import torch

from tokenmill import LLM, SamplingParams

K = 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)


def flat(prompt_logprobs):
    """(token ids, their logprobs, the top ids, their logprobs, ranks) of positions 1.. (position 0 is None)."""
    assert prompt_logprobs[0] is None
    lps = prompt_logprobs[1:]
    return ([lp.token_id for lp in lps], torch.tensor([lp.logprob for lp in lps]), [list(lp.top) for lp in lps],
            torch.tensor([list(lp.top.values()) for lp in lps]), [lp.rank for lp in lps])


def assert_same(got, want, atol=1e-4):
    ids, lps, top_ids, top_lps, ranks = flat(got)
    w_ids, w_lps, w_top_ids, w_top_lps, w_ranks = flat(want)
    assert ids == w_ids and top_ids == w_top_ids and ranks == w_ranks
    torch.testing.assert_close(lps, w_lps, atol=atol, rtol=0)
    torch.testing.assert_close(top_lps, w_top_lps, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def reference(chat_prompt_ids):
    """Each prompt alone, default settings."""
    llm = LLM(dtype="float32")
    return [llm.generate([p], PARAMS)[0] for p in chat_prompt_ids]


def test_matches_transformers(chat_prompt_ids, default_model_path, reference):
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(default_model_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    for ids, out in zip(chat_prompt_ids, reference):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]
        assert len(out.prompt_logprobs) == len(ids) == len(out.prompt_token_ids)
        got_ids, got_lps, top_ids, top_lps, ranks = flat(out.prompt_logprobs)
        assert got_ids == ids[1:]
        want = lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(got_lps, want, atol=2e-3, rtol=0)
        # the alternatives are transformers' best K, best first (their values; ids may swap only within ties)
        torch.testing.assert_close(top_lps, lp.topk(K).values, atol=2e-3, rtol=0)
        torch.testing.assert_close(top_lps, lp.gather(1, torch.tensor(top_ids)), atol=2e-3, rtol=0)
        want_ranks = (lp > want[:, None]).sum(-1) + 1
        assert (torch.tensor(ranks) - want_ranks).abs().max() <= 1  # a near-tie may order one token differently
        assert (torch.tensor(ranks) == want_ranks).float().mean() > 0.9


@pytest.mark.parametrize("engine_kwargs", [
    dict(),                                         # all prompts in one step
    dict(max_num_batched_tokens=7, block_size=16),  # chunks that end mid-block, several steps a prompt
    dict(block_size=1),
    dict(enable_prefix_caching=False, max_num_batched_tokens=16),
])
def test_independent_of_batching_and_chunking(chat_prompt_ids, reference, engine_kwargs):
    outs = LLM(dtype="float32", **engine_kwargs).generate(chat_prompt_ids, PARAMS)
    for out, ref in zip(outs, reference):
        assert_same(out.prompt_logprobs, ref.prompt_logprobs)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_prefix_cache_is_bypassed_for_owed_positions(chat_prompt_ids, reference):
    """A cached prompt still gets every prompt logprob (its positions are computed again), and a request without
    prompt logprobs still hits the cache afterwards."""
    llm = LLM(dtype="float32", block_size=4)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = chat_prompt_ids[0]
    first = llm.generate([ids], plain)[0]
    assert first.num_cached_tokens == 0
    again = llm.generate([ids], PARAMS)[0]
    assert again.num_cached_tokens == 0
    assert_same(again.prompt_logprobs, reference[0].prompt_logprobs)
    third = llm.generate([ids], plain)[0]
    assert third.num_cached_tokens == (len(ids) - 1) // 4 * 4 and third.prompt_logprobs is None


def test_forced_preemption(chat_prompt_ids, reference):
    """Recomputed after preemption, a prompt's logprobs are neither lost nor repeated."""
    from tokenmill.runner.model_runner import kv_bytes_per_token
    llm = LLM(dtype="float32", max_model_len=256)
    per_token = kv_bytes_per_token(llm.llm_engine.model_config, torch.float32)
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory=per_token * 16 * 6, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate(chat_prompt_ids, params)
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0
    for out, ref in zip(outs, reference):
        assert_same(out.prompt_logprobs, ref.prompt_logprobs)


def test_n_samples_and_zero_alternatives(chat_prompt_ids, reference):
    llm = LLM(dtype="float32")
    out = llm.generate([chat_prompt_ids[1]], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4,
                                                            prompt_logprobs=0))[0]
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == len(chat_prompt_ids[1])
    assert all(lp.top == {} for lp in out.prompt_logprobs[1:])
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]]),
                               flat(reference[1].prompt_logprobs)[1], atol=1e-4, rtol=0)


def test_with_speculation(chat_prompt_ids, reference):
    outs = LLM(dtype="float32", speculative="ngram", num_speculative_tokens=4).generate(chat_prompt_ids, PARAMS)
    for out, ref in zip(outs, reference):
        assert_same(out.prompt_logprobs, ref.prompt_logprobs)


def test_async_scheduling_computes_them(chat_prompt_ids, reference):
    """Steps owing prompt logprobs run synchronously; the rest of the request may launch ahead."""
    outs = LLM(dtype="float32", async_scheduling=True).generate(chat_prompt_ids, PARAMS)
    for out, ref in zip(outs, reference):
        assert_same(out.prompt_logprobs, ref.prompt_logprobs)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_one_token_prompt():
    out = LLM(dtype="float32").generate([[42]], PARAMS)[0]
    assert out.prompt_logprobs == [None]
