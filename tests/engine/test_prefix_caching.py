"""Prefix caching on the real model: multi-turn chat reuses the whole previous conversation, and greedy
output is the same with the cache on and off."""
import random

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def converse(llm, turns):
    """Chat turn by turn, resending the whole conversation; returns each turn's answer, prompt and cache hit."""
    tok = llm.get_tokenizer()
    messages, answers, prompts, hits = [], [], [], []
    engine = llm.llm_engine
    for user in turns:
        messages.append({"role": "user", "content": user})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        out = llm.generate([ids], GREEDY)[0]
        prompts.append(ids)
        hits.append(out.num_cached_tokens)
        answers.append(out.outputs[0].token_ids)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    engine.kv_cache.check_invariants()
    return answers, prompts, hits


def test_multi_turn_hits_previous_conversation_and_matches_uncached():
    """Each turn is served from the cache for the whole previous conversation: the previous prompt and the
    previous answer, up to the answer's last token (sampled, never computed), in whole blocks. Blocks of 4
    make the answer's blocks count: the previous prompt alone would give fewer hit tokens."""
    turns = ["Hi! What is the capital of France?", "And what is it famous for?", "Name one museum there."]
    bs = 4
    cached = LLM(dtype="float32", block_size=bs)
    plain = LLM(dtype="float32", block_size=bs, enable_prefix_caching=False)
    answers_c, prompts, hits = converse(cached, turns)
    answers_p, _, hits_p = converse(plain, turns)
    assert answers_c == answers_p
    assert hits_p == [0] * len(turns)
    assert hits[0] == 0
    for hit, prompt, prev_prompt, prev_answer in zip(hits[1:], prompts[1:], prompts, answers_c):
        previous = prev_prompt + prev_answer
        assert prompt[:len(previous)] == previous  # the template re-renders the answer as the same tokens
        assert hit == (len(previous) - 1) // bs * bs
        assert hit > len(prev_prompt) // bs * bs  # more than the previous prompt's blocks


def run_workload(llm, prompts, priorities, arrive_at, abort_at):
    """Add each request at its step, abort some at theirs, step until done; returns {request id: tokens}."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    done, step = {}, 0
    while step <= max(arrive_at) or engine.has_unfinished_requests():
        for i, (p, prio, t) in enumerate(zip(prompts, priorities, arrive_at)):
            if t == step:
                engine.add_request(str(i), p, params, priority=prio)
        engine.abort_request([str(i) for i, t in abort_at.items() if t == step])
        for out in engine.step():
            done[out.request_id] = out.outputs[0]
        engine.kv_cache.check_invariants()
        step += 1
    stats = engine.get_stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert len(done) == len(prompts)
    for i, c in done.items():
        assert c.finish_reason == ("abort" if int(i) in abort_at and len(c.token_ids) < 6 else "length")
    return {i: c.token_ids for i, c in done.items()}


def test_random_shared_prefixes_same_greedy_tokens():
    """50 requests sharing random prefixes, arriving over time with random priorities, under a small KV pool
    (preemption and eviction) and chunked prefill, some aborted: every request not aborted gets the same greedy
    tokens with the prefix cache on and off."""
    rng = random.Random(0)
    n = 50
    prefixes = [[rng.randrange(1000, 20000) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    prompts = [rng.choice(prefixes) + [rng.randrange(1000, 20000) for _ in range(rng.randrange(1, 10))]
               for _ in range(n)]
    priorities = [rng.randrange(3) for _ in range(n)]
    arrive_at = sorted(rng.randrange(30) for _ in range(n))
    abort_at = {i: arrive_at[i] + rng.randrange(4) for i in rng.sample(range(n), 6)}
    kw = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 8,
          "scheduling_policy": "priority", "num_gpu_blocks_override": 48}
    llm_c = LLM(**kw)
    llm_p = LLM(**kw, enable_prefix_caching=False)
    a = run_workload(llm_c, prompts, priorities, arrive_at, abort_at)
    b = run_workload(llm_p, prompts, priorities, arrive_at, abort_at)
    kept = [str(i) for i in range(n) if i not in abort_at]
    assert [a[i] for i in kept] == [b[i] for i in kept]
    for llm in (llm_c, llm_p):
        assert llm.llm_engine.get_stats()["num_preemptions"] > 0
        assert llm.llm_engine.get_stats()["num_aborts"] > 0
    assert llm_c.llm_engine.get_stats()["prefix_cache_hits"] > 0
    assert llm_p.llm_engine.get_stats()["prefix_cache_hits"] == 0
