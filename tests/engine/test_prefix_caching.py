"""Prefix caching on the real model: multi-turn chat reuses the whole previous conversation, and greedy
output is the same with the cache on and off."""
import random

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def converse(llm, turns):
    tok = llm.get_tokenizer()
    messages, answers, hits = [], [], []
    engine = llm.llm_engine
    for user in turns:
        messages.append({"role": "user", "content": user})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        out = llm.generate([ids], GREEDY)[0]
        hits.append((out.num_cached_tokens, len(ids)))
        answers.append(out.outputs[0].token_ids)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    engine.kv_cache.check_invariants()
    return answers, hits


def test_multi_turn_hits_previous_conversation_and_matches_uncached():
    turns = ["Hi! What is the capital of France?", "And what is it famous for?", "Name one museum there."]
    cached = LLM(dtype="float32", block_size=16)
    plain = LLM(dtype="float32", block_size=16, enable_prefix_caching=False)
    answers_c, hits = converse(cached, turns)
    answers_p, hits_p = converse(plain, turns)
    assert answers_c == answers_p
    assert all(h == 0 for h, _ in hits_p)
    prev_len = 0
    for (hit, n), prev_prompt in zip(hits[1:], [h[1] for h in hits[:-1]]):
        # everything of the previous prompt that filled whole blocks is served from the cache
        assert hit >= (prev_prompt // 16) * 16 - 16 and hit > 0
        prev_len = n
    assert prev_len > 0


def test_random_shared_prefixes_same_greedy_tokens():
    rng = random.Random(0)
    llm_c = LLM(dtype="float32", block_size=4, max_num_batched_tokens=64)
    llm_p = LLM(dtype="float32", block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    prefixes = [[rng.randrange(1000, 20000) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    prompts = [rng.choice(prefixes) + [rng.randrange(1000, 20000) for _ in range(rng.randrange(1, 10))]
               for _ in range(10)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in llm_c.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in llm_p.generate(prompts, params)]
    assert a == b
    assert llm_c.llm_engine.kv_cache.prefix_hits > 0
