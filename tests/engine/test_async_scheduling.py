"""Async scheduling (step N+1 launched before step N's tokens are read back, the pending tokens fed on the
device) changes nothing a user sees: the same tokens, texts, finish reasons and logprobs as the synchronous
engine, through EOS and stop strings, n > 1 with prefix sharing, chunked prefill, preemption, seeded sampling,
logit_bias (launched ahead: it reads no token on the host), penalties and logprobs (which fall back to synchronous
steps) and aborts, with every KV block returned."""
import pytest

from tokenmill import LLM, SamplingParams

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
             "Why is the sky blue?", "Name three planets.", "What does a compiler do?"]
ENGINE = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=48, block_size=8,
              kv_cache_memory=16 * 8 * 2 * 30 * 3 * 64 * 4)  # 16 blocks of 8 tokens: long runs preempt


@pytest.fixture(scope="module")
def engines():
    return {mode: LLM(async_scheduling=mode, **ENGINE) for mode in (False, True)}


def chat_ids(llm: LLM, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def run(llm: LLM, params: list[SamplingParams]) -> list[list[tuple]]:
    prompts = [chat_ids(llm, q) for q in QUESTIONS]
    outs = llm.generate(prompts, params)
    engine = llm.llm_engine
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.usable_blocks  # every block returned
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [(lp.token_id, round(lp.logprob, 4)) for lp in c.logprobs])
             for c in o.outputs] for o in outs]


def test_same_outputs_as_synchronous(engines) -> None:
    params = [SamplingParams(temperature=0, max_tokens=40),                                   # EOS may end it
              SamplingParams(temperature=0, max_tokens=7),                                    # max_tokens
              SamplingParams(temperature=0, max_tokens=60, stop=["."]),                       # stop string
              SamplingParams(temperature=0.8, max_tokens=30, seed=3, n=2),                    # seeded, n > 1
              SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, min_tokens=5,
                             logit_bias={314: -100.0, 30: 2.0}),
              SamplingParams(temperature=0.7, top_k=20, max_tokens=25, seed=11)]
    runner = engines[True].llm_engine.runner
    launches = []
    launch = runner.launch
    runner.launch = lambda *a: launches.append(1) or launch(*a)
    try:
        sync, asynchronous = (run(engines[mode], params) for mode in (False, True))
    finally:
        del runner.launch
    assert asynchronous == sync
    assert len(launches) > 50  # every step of this batch was launched ahead
    assert engines[True].llm_engine.scheduler.stats.num_preemptions > 0  # the small pool preempted


def test_penalties_and_logprobs_fall_back_to_synchronous_steps(engines) -> None:
    params = [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=9, logprobs=2)] + \
             [SamplingParams(temperature=0, max_tokens=20)] * (len(QUESTIONS) - 2)
    assert run(engines[True], params) == run(engines[False], params)


def test_abort_while_a_token_is_on_the_device(engines) -> None:
    llm = engines[True]
    engine = llm.llm_engine
    ids = chat_ids(llm, QUESTIONS[0])
    engine.add_request("a", ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None  # a step is launched and not read back
    engine.abort_request("a")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["a"].outputs[0].finish_reason == "abort"
    assert all(t >= 0 for o in finished.values() for t in o.outputs[0].token_ids)  # no placeholder leaked
    assert len(finished["b"].outputs[0].token_ids) == 6
    engine.step()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.usable_blocks


def test_a_failed_launch_feeds_no_stale_token(engines, monkeypatch) -> None:
    """Sampling fails while it draws the sampled rows, after writing into the runner's `sampled` buffer: the step
    in flight is read back from its own copy and the next launch takes nothing from the buffer, so stepping on
    gives the synchronous engine's tokens."""
    ids = chat_ids(engines[True], QUESTIONS[1])
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)]
    want = [o.outputs[0].token_ids for o in engines[False].generate([ids, ids], params)]
    engine = engines[True].llm_engine
    engine.add_request("greedy", ids, params[0])
    engine.add_request("seeded", ids, params[1])
    finished = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids

    while engine._in_flight is None or min(r.num_output_tokens for r in engine.scheduler.running) < 3:
        step()
    sampler = engine.runner.sampler
    draw = sampler.draw

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(sampler, "draw", draw)
        engine.runner.sampled.fill_(7)  # what a sampler failing halfway may leave in the buffer
        raise RuntimeError("injected")
    monkeypatch.setattr(sampler, "draw", fail_once)
    with pytest.raises(RuntimeError, match="injected"):
        step()
    while engine.has_unfinished_requests():
        step()
    assert [finished["greedy"], finished["seeded"]] == want
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.usable_blocks
