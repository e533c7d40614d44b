"""The offline API end to end on the real default model: sampling options, n > 1, stop handling,
logprobs, aborts and bad input."""
import os
import subprocess
import sys
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.core.scheduler import QueueFullError
from tokenmill.request import RequestStatus


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=512, max_queue_len=64)


@pytest.fixture(scope="module")
def small_llm():
    """Prefill chunks of 16 tokens and a pool of 8 blocks of 16: a long prompt takes several steps, and a few
    requests of ~60 + 20 tokens cannot all run at once."""
    return LLM(dtype="float32", max_model_len=256, max_num_batched_tokens=16, num_gpu_blocks_override=9)


def prompt(llm, text):
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def test_chat_answers_sensibly(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    assert out.metrics.time_to_first_token > 0


def test_seed_gives_same_output_whatever_the_batch(llm):
    p = prompt(llm, "Write a short poem about autumn.")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([p], seeded)[0].outputs[0].token_ids
    others = [prompt(llm, f"Count to {i}.") for i in range(3)]
    batch = llm.generate(others[:2] + [p] + others[2:], [SamplingParams(temperature=1.0, max_tokens=8)] * 2
                         + [seeded] + [SamplingParams(temperature=0.7, max_tokens=12)])
    assert batch[2].outputs[0].token_ids == alone
    again = llm.generate([p], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True))
    assert again[0].outputs[0].token_ids != alone


def test_n_samples_share_prompt_blocks(llm):
    """n samples reuse the prompt's full blocks through the prefix cache; while they run, those blocks are one set
    referenced by every sample, and the last, partial block (prompt tail, then each sample's own tokens) is a
    different block for each sample, since a shared block is never written."""
    engine = llm.llm_engine
    p = prompt(llm, "Name a fruit. " * 8)
    hits_before = engine.kv_cache.prefix_hits
    out = llm.generate([p], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    full_blocks = (len(p) - 1) // engine.kv_cache.block_size
    assert engine.kv_cache.prefix_hits - hits_before >= 3 * full_blocks * engine.kv_cache.block_size
    assert len(p) % engine.kv_cache.block_size  # the prompt ends inside a block
    rid = engine.add_request(None, p, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    children = engine.groups[rid].children
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        if any(c.is_finished for c in children):
            continue
        tables = [engine.kv_cache.get_block_ids(c.request_id) for c in children]
        assert all(t[:full_blocks] == tables[0][:full_blocks] for t in tables)
        assert all(engine.kv_cache.pool.blocks[b].ref_cnt == 4 for b in tables[0][:full_blocks])
        assert len({t[-1] for t in tables}) == 4
        tails = [b for t in tables for b in t[full_blocks:]]
        assert len(tails) == len(set(tails))
        checked += 1
    assert checked == 7  # every step but the last, which ends all four
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.usable_blocks


def test_stop_strings_are_never_leaked(llm):
    p = prompt(llm, "What is the capital of France?")
    full = llm.generate([p], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
    assert "Paris" in full
    cut = "is Par"  # spans two tokens
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, stop=[cut]))[0].outputs[0]
    assert out.text == full[: full.index(cut)]
    assert out.finish_reason == "stop" and out.stop_reason == cut
    engine = llm.llm_engine
    engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=20, stop=[cut]))
    streamed = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            streamed += o.outputs[0].delta_text
    assert streamed == out.text
    kept = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, stop=[cut],
                                            include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[: full.index(cut) + len(cut)]


def test_stop_token_ids_and_max_tokens(llm):
    p = prompt(llm, "What is the capital of France?")
    ids = llm.generate([p], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].token_ids
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[3]]))[0].outputs[0]
    assert out.token_ids == ids[:4] and out.stop_reason == ids[3]
    three = llm.generate([p], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert three.token_ids == ids[:3] and three.finish_reason == "length"
    assert out.text == three.text  # a stop token's text is no output (vLLM) ...
    kept = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[3]],
                                            include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text.startswith(three.text) and len(kept.text) > len(three.text)  # ... unless asked for
    eos = llm.generate([p], SamplingParams(temperature=0, max_tokens=60, skip_special_tokens=False))[0].outputs[0]
    assert eos.finish_reason == "stop" and "<|im_end|>" not in eos.text


def test_stop_strings_wait_for_min_tokens(llm):
    """As EOS and stop tokens, stop strings count from min_tokens on (vLLM)."""
    p = prompt(llm, "What is the capital of France?")
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    first = free.text.split()[0]
    assert llm.generate([p], SamplingParams(temperature=0, max_tokens=12, stop=[first]))[0].outputs[0].text == ""
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, stop=[first], min_tokens=5))[0].outputs[0]
    assert len(out.token_ids) >= 5 and out.token_ids == free.token_ids[:len(out.token_ids)]


def test_logprobs(llm):
    p = prompt(llm, "Say yes.")
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tid, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tid and len(lp.top) == 3 and next(iter(lp.top)) == tid
        assert lp.logprob <= 0 and abs(lp.top[tid] - lp.logprob) < 1e-6


def test_abort_frees_blocks_in_every_state(llm):
    engine = llm.llm_engine
    long_prompt = prompt(llm, "Tell me everything about the history of Rome. " * 10)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("running", long_prompt, params)
    engine.step()
    engine.add_request("waiting", long_prompt[:-3], params)
    assert engine.kv_cache.num_free_blocks < engine.kv_cache.usable_blocks
    engine.abort_request("running")
    engine.abort_request("waiting")
    outs = engine.step()
    assert {o.request_id for o in outs} == {"running", "waiting"}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.usable_blocks
    engine.kv_cache.check_invariants()


def run_to_end(engine, outs):
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    return outs


def test_abort_mid_prefill_chunk_frees_blocks(small_llm):
    """A request aborted between two chunks of its prompt gives its blocks back at once, and the request
    waiting behind it still runs to the end."""
    engine = small_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("chunked", prompt(small_llm, "Tell me everything about the history of Rome. " * 3), params)
    engine.add_request("other", prompt(small_llm, "Say yes."), params)
    outs = {o.request_id: o for o in engine.step()}
    req = engine.groups["chunked"].children[0]
    assert req.status == RequestStatus.RUNNING and 0 < req.num_computed_tokens < req.num_prompt_tokens
    stats = engine.get_stats()
    assert stats["num_blocks_free"] < stats["num_blocks_total"]
    engine.abort_request("chunked")
    stats = engine.get_stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"] and stats["num_running"] == 0
    run_to_end(engine, outs)
    assert outs["chunked"].outputs[0].finish_reason == "abort" and outs["chunked"].outputs[0].token_ids == []
    assert outs["other"].outputs[0].finish_reason == "length" and len(outs["other"].outputs[0].token_ids) == 8
    stats = engine.get_stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    engine.kv_cache.check_invariants()


def test_abort_while_preempted_frees_blocks(small_llm):
    """Three requests that cannot fit the pool together: one is preempted (back in the waiting queue, no
    blocks); aborting it there leaves every block free once the other two have run to the end."""
    engine = small_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    topics = ["the history of Rome", "how bread is baked", "the planets of the solar system"]
    ids = [f"pre{i}" for i in range(3)]
    for rid, topic in zip(ids, topics):
        engine.add_request(rid, prompt(small_llm, f"Tell me everything about {topic}. " * 3), params)
    outs, victim = {}, None
    for _ in range(300):
        for o in engine.step():
            outs[o.request_id] = o
        preempted = [rid for rid in ids if rid in engine.groups
                     and engine.groups[rid].children[0].status == RequestStatus.PREEMPTED]
        if preempted:
            victim = preempted[0]
            break
    assert victim is not None, "no request was preempted"
    assert engine.get_stats()["num_preempted_waiting"] >= 1
    assert engine.kv_cache.get_block_ids(victim) == []
    engine.abort_request(victim)
    run_to_end(engine, outs)
    assert outs[victim].outputs[0].finish_reason == "abort"
    for rid in ids:
        if rid != victim:
            assert outs[rid].outputs[0].finish_reason == "length" and len(outs[rid].outputs[0].token_ids) == 20
    stats = engine.get_stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    engine.kv_cache.check_invariants()


def test_bad_input_is_a_clear_error_and_engine_keeps_working(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[1] * 600])
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([[10 ** 9]])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    engine.add_request("dup", [1, 2, 3])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2, 3])
    engine.abort_request("dup")
    engine.add_request("pair#1", [1, 2, 3])  # the id of a sample of "pair" below: that request is refused whole
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("pair", [1, 2, 3], SamplingParams(n=2))
    assert "pair#0" not in engine.scheduler.requests and "pair#0" not in engine.child_to_group
    engine.abort_request("pair#1")
    engine.add_request("top-seed", [1, 2, 3], SamplingParams(n=2, seed=2 ** 63 - 1))  # samples' seeds wrap
    engine.abort_request("top-seed")
    with pytest.raises(ValueError, match="token ids must be in"):  # a bad prompt leaves none of the call queued
        llm.generate([[1, 2, 3], [10 ** 9]])
    assert not engine.scheduler.requests
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids must be in \[0, {vocab}\)"):
        engine.add_request("bias", [1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    assert not engine.scheduler.requests
    with pytest.raises(ValueError, match="priorities"):
        llm.generate([[1, 2, 3], [4, 5]], priority=[0])
    for name in ("stop", "stop_token_ids"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: 5})
    for bad in ([{"role": "user", "content": 5}], [{"content": "hi"}], ["hello"]):
        with pytest.raises(ValueError, match="message 0|conversation must be"):
            llm.chat(bad)
    with pytest.raises(ValueError, match="messages must be a list of .* got str 'Hi'"):
        llm.chat("Hi")
    for bad in (None, 5):  # were TypeErrors: "'NoneType' object is not iterable"
        with pytest.raises(ValueError, match=f"prompts must be a string, .* got {type(bad).__name__}"):
            llm.generate(bad)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    plain = [{"role": "user", "content": "What is the capital\nof France?"}]
    greedy = SamplingParams(temperature=0, max_tokens=5)
    assert llm.chat(parts, greedy)[0].outputs[0].text == llm.chat(plain, greedy)[0].outputs[0].text
    with pytest.raises(QueueFullError):
        for i in range(100):
            engine.add_request(f"q{i}", [1, 2, 3])
    engine.abort_request([f"q{i}" for i in range(100)])
    engine.step()
    assert not engine.has_unfinished_requests()
    assert "Paris" in llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                               SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text


def test_an_aborted_id_is_free_at_once_and_reported_once(llm):
    """As in vLLM, an aborted request is gone when abort_request returns: its id can be taken again and a failed
    generate() leaves nothing unfinished; the next step still reports the aborted one, once, before the new one."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("again", [1, 2, 3], params)
    engine.step()
    engine.abort_request("again")
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.usable_blocks
    engine.add_request("again", [4, 5, 6], params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [(o.request_id, o.outputs[0].finish_reason) for o in engine.step() if o.finished]
    assert finished == [("again", "abort"), ("again", "length")]
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([[1, 2, 3], [10 ** 9]])
    assert not engine.has_unfinished_requests()
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort"]  # the call's first prompt
    assert engine.step() == []


@pytest.mark.parametrize("kwargs, message", [
    ({"arrival_time": "x"}, "arrival_time must be a finite number of seconds or None, got 'x'"),
    ({"arrival_time": float("nan")}, "arrival_time must be a finite number"),
    ({"timeout_s": True}, "timeout_s must be a finite number"),
    ({"timeout_s": -1}, r"timeout_s must be > 0 seconds"),
    ({"priority": 5}, "priority 5 was given but priority scheduling is not enabled"),
    ({"request_id": 7}, "request_id must be a string or None, got int 7"),
    ({"sampling_params": {"max_tokens": 1}}, "sampling_params must be a SamplingParams, got dict"),
    ({"sampling_params": SamplingParams(stop_token_ids=[10 ** 6])}, r"stop_token_ids token ids must be in \[0, "),
])
def test_bad_request_arguments_are_refused_when_added(llm, kwargs, message):
    """A request argument of the wrong type or range is the caller's ValueError at add_request; a bad arrival time
    taken as given made every later step fail comparing it."""
    engine = llm.llm_engine
    call = {"request_id": "bad", "prompt": [1, 2, 3], "sampling_params": SamplingParams(max_tokens=2), **kwargs}
    with pytest.raises(ValueError, match=message):
        engine.add_request(**call)
    assert not engine.scheduler.requests and not engine.has_unfinished_requests()
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].finish_reason \
        == "length"


def test_generate_takes_vllm_prompt_dicts(llm):
    """vLLM's TextPrompt and TokensPrompt dicts, alone or in a list, are the prompts they hold (list() of a lone dict
    made its key "prompt" the prompt)."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    text = "What is the capital of France?"
    ids = llm.get_tokenizer().encode(text)
    plain = llm.generate(text, greedy)[0]
    for given in ({"prompt": text}, [{"prompt": text}]):
        out = llm.generate(given, greedy)
        assert len(out) == 1 and out[0].prompt == text and out[0].outputs[0].token_ids == plain.outputs[0].token_ids
    out = llm.generate([{"prompt_token_ids": ids}, {"prompt": "Hi"}], greedy)
    assert out[0].prompt is None and out[0].prompt_token_ids == ids
    assert out[0].outputs[0].token_ids == plain.outputs[0].token_ids and out[1].prompt == "Hi"
    with pytest.raises(ValueError, match='dict prompt must be {"prompt": text} or {"prompt_token_ids"'):
        llm.generate({"text": text})


def test_sampling_params_that_are_not_sampling_params_queue_nothing(llm):
    engine = llm.llm_engine
    for bad in ([SamplingParams(), None], {"temperature": 0}):
        with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them"):
            llm.generate(["Hi", "Yo"], bad)
        assert not engine.has_unfinished_requests() and not engine.scheduler.requests


def test_timed_out_seeded_request_starts_afresh_under_its_id(llm):
    """A timed-out request's seeded generator is dropped, as an aborted one's: a new request under the same id and
    seed samples what that seed gives."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    ids = prompt(llm, "Tell me a story.")
    expected = llm.generate([ids], params)[0].outputs[0].token_ids
    engine.add_request("late", ids, params, timeout_s=60)
    for _ in range(3):
        engine.step()
    clock = engine.scheduler.clock
    engine.scheduler.clock = lambda: time.monotonic() + 120
    try:
        outs = run_to_end(engine, {})
    finally:
        engine.scheduler.clock = clock
    assert outs["late"].outputs[0].finish_reason == "abort" and len(outs["late"].outputs[0].token_ids) == 3
    engine.add_request("late", ids, params)
    assert run_to_end(engine, {})["late"].outputs[0].token_ids == expected
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.usable_blocks


def test_cumulative_logprob(llm):
    """vLLM's CompletionOutput.cumulative_logprob: the chosen tokens' logprobs summed, None without logprobs."""
    p = prompt(llm, "Say yes.")
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, logprobs=0))[0].outputs[0]
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))
    assert out.cumulative_logprob < 0
    assert llm.generate([p], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].cumulative_logprob is None


def test_cli_generate_streams_text():
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "What is the capital of France?",
                        "--max-tokens", "12", "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_cli_chat_repl_is_multi_turn(encoding):
    """A message that is not UTF-8 or too long for the context is said and dropped, and the chat goes on (the
    first ended it with a traceback, the second with status 2). ascii: the C locale's stdin, whose undecodable
    bytes come as surrogates."""
    lines = b"\xff\xfe\n" + b"word " * 1000 + b"\nWhat is the capital of France?\nAnd of Italy?\n/exit\n"
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "chat", "--max-tokens", "12", "--dtype", "float32",
                        "--max-model-len", "512"], input=lines, capture_output=True, timeout=300,
                       env={**os.environ, "PYTHONIOENCODING": f"{encoding}:surrogateescape" if encoding == "ascii"
                            else "utf-8"})
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "tokenmill chat: the message is not valid UTF-8; the message was not sent" in err
    assert "maximum context length" in err or "max_model_len" in err, err
    assert "Paris" in out and "Rome" in out


def test_requests_that_could_never_run_as_asked_are_refused(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"n=65 samples never fit the waiting queue of 64 requests"):
        engine.add_request("many", [1, 2, 3], SamplingParams(n=65))  # was QueueFullError: "retry later"
    # "x#0" named by a user while sample 0 of "x" has finished and sample 1 runs: it took over the sample's
    # mapping, which "x" ending then removed
    engine.add_request("x", [1, 2, 3], SamplingParams(n=2, max_tokens=1, ignore_eos=True))
    engine.groups["x"].children[1].sampling_params = SamplingParams(max_tokens=4, ignore_eos=True)
    while not engine.groups["x"].children[0].is_finished:
        engine.step()
    with pytest.raises(ValueError, match=r"request id 'x#0' is already in use"):
        engine.add_request("x#0", [1, 2, 3])
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.groups and not engine.child_to_group
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.usable_blocks


def test_stop_strings_without_a_tokenizer_are_refused():
    """They were ignored: with no tokenizer there is no text to find them in, so the request ran to its length."""
    engine = LLM(dtype="float32", max_model_len=128, skip_tokenizer_init=True).llm_engine
    with pytest.raises(ValueError, match=r"stop strings \['\.'\] need a tokenizer.*use stop_token_ids"):
        engine.add_request(None, [1, 2, 3], SamplingParams(stop=["."]))
    engine.add_request(None, [1, 2, 3], SamplingParams(stop_token_ids=[5], max_tokens=2))
    assert engine.has_unfinished_requests()


def test_generate_takes_more_prompts_than_the_queue_holds(llm):
    """max_queue_len (64 here) guards the server; offline generate runs what is queued to make room."""
    outs = llm.generate([[1, 2, 3 + i] for i in range(100)], SamplingParams(max_tokens=1))
    assert [o.prompt_token_ids[-1] for o in outs] == [3 + i for i in range(100)]
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)


def test_final_only_requests_are_reported_once(llm):
    """A FINAL_ONLY request (what LLM.generate sends) gives one output, at the end, equal to the streamed one's last;
    a streaming request beside it still reports every step."""
    from tokenmill.sampling_params import RequestOutputKind
    engine = llm.llm_engine
    ids = prompt(llm, "Name three colors.")
    engine.add_request("final", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                    output_kind=RequestOutputKind.FINAL_ONLY))
    engine.add_request("stream", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    seen: dict[str, list] = {"final": [], "stream": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    assert len(seen["stream"]) == 6 and seen["stream"][-1].finished
    assert seen["final"][0].outputs[0].token_ids == seen["stream"][-1].outputs[0].token_ids
    assert seen["final"][0].outputs[0].text == seen["stream"][-1].outputs[0].text
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="final")


def test_allowed_token_ids_and_truncate_prompt_tokens(llm):
    """vLLM's two options: only the allowed ids are generated (greedy and sampled, beside a free request in the same
    batch), and a truncated prompt runs as its last k tokens would."""
    ids = prompt(llm, "Name a colour.")
    yes_no = [llm.get_tokenizer().encode(w, add_special_tokens=False)[0] for w in ("Yes", "No")]
    free, greedy, sampled = llm.generate([ids] * 3, [
        SamplingParams(temperature=0, max_tokens=4),
        SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=yes_no),
        SamplingParams(temperature=1.0, seed=1, max_tokens=8, allowed_token_ids=yes_no)])
    assert not set(free.outputs[0].token_ids) <= set(yes_no)
    assert set(greedy.outputs[0].token_ids) <= set(yes_no) and set(sampled.outputs[0].token_ids) <= set(yes_no)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cut, tail = llm.generate([ids, ids[-5:]], [SamplingParams(**{**plain.__dict__, "truncate_prompt_tokens": 5}),
                                               plain])
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    long = [1] * 600  # past max_model_len=512 until truncated
    assert llm.generate([long], SamplingParams(max_tokens=2, truncate_prompt_tokens=100))[0].prompt_token_ids == [1] * 100
    with pytest.raises(ValueError, match="512"):  # -1 (vLLM's): the context length, which leaves no room to generate
        llm.generate([long], SamplingParams(max_tokens=2, truncate_prompt_tokens=-1))
    assert llm.generate([ids], SamplingParams(**{**plain.__dict__, "truncate_prompt_tokens": -1}))[0].prompt_token_ids \
        == ids


def test_allowed_token_ids_that_other_bans_cover_are_refused(llm):
    """Every allowed token banned (by min_tokens' ban of EOS and stop ids, or by one-token bad words) left all
    logits -inf, and the sampler answered EOS, which was not allowed: now a ValueError naming the two fields. A ban
    that leaves one allowed token is fine, and that token is the output."""
    tok = llm.get_tokenizer()
    yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in ("Yes", "No"))
    eos = tok.eos_token_ids[0]
    ids = prompt(llm, "Name a colour.")
    refused = [(dict(allowed_token_ids=[eos], min_tokens=2), "min_tokens=2 bans EOS and stop_token_ids"),
               (dict(allowed_token_ids=[yes], stop_token_ids=[yes], min_tokens=1), "allowed_token_ids"),
               (dict(allowed_token_ids=[yes, no], bad_words=["Yes", "No"]), "bad_words ban every token")]
    for kw, message in refused:
        with pytest.raises(ValueError, match=message):
            llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, **kw))
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[yes, no, eos],
                                             min_tokens=3, bad_words=["Yes"]))[0].outputs[0]
    assert out.token_ids == [no] * 3
    assert llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[eos],
                                              min_tokens=2, ignore_eos=True))[0].outputs[0].token_ids == [eos] * 3


def test_chat_continues_a_prefilled_answer_and_takes_a_template(llm):
    """vLLM's LLM.chat options: continue_final_message goes on with the assistant's words (no new turn),
    chat_template replaces the model's template for the call, chat_template_kwargs gives it variables."""
    greedy = SamplingParams(temperature=0, max_tokens=6)
    prefilled = [{"role": "user", "content": "What is the capital of France?"},
                 {"role": "assistant", "content": "The capital of France is"}]
    out = llm.chat(prefilled, greedy, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.outputs[0].text.startswith(" Paris")
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids, skip_special_tokens=False).endswith("assistant\nThe capital of France is")
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(prefilled, greedy, continue_final_message=True)
    plain = llm.chat(prefilled[:1], greedy, chat_template="Q: {{ messages[0].content }}\nA:")[0]
    assert plain.prompt_token_ids == tok.encode("Q: What is the capital of France?\nA:", add_special_tokens=False)
    asked = llm.chat(prefilled[:1], greedy, chat_template="{{ ask }}: {{ messages[0].content }}\nA:",
                     chat_template_kwargs={"ask": "Q"})[0]
    assert asked.prompt_token_ids == plain.prompt_token_ids and asked.outputs[0].text == plain.outputs[0].text
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set add_generation_prompt"):
        llm.chat(prefilled[:1], greedy, chat_template_kwargs={"add_generation_prompt": False})


def test_bad_words_never_end_the_output(llm):
    """vLLM's bad_words: the tokens of a word (alone and after a space) never end the output (" night" may not
    follow "Every", "keeper" never comes); greedy output is the free one up to the token that would complete a
    word, and the same with async scheduling and with n-gram speculation (whose drafts, copied from the prompt,
    propose the words)."""
    passage = "Every night its keeper climbed the narrow stairs and watched the ships pass through the strait."
    ids = prompt(llm, f"Repeat this text word for word: {passage}")
    free = llm.generate([ids], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=30, bad_words=["Every night", "keeper"])
    got = llm.generate([ids], params)[0].outputs[0].token_ids
    seqs = llm.get_tokenizer().bad_words_token_ids(params.bad_words)
    assert [len(s) for s in seqs] == [2, 2, 1, 1]  # "Every night" is two tokens, "keeper" one, either spelling

    def ends(tokens: list[int]) -> list[int]:
        return [i + len(s) for s in seqs for i in range(len(tokens) - len(s) + 1) if tokens[i:i + len(s)] == s]

    assert ends(free) and not ends(got)
    first = min(ends(free)) - 1  # where the free output completed the word
    assert got[:first] == free[:first] and got[first] != free[first]
    for kw in (dict(async_scheduling=True), dict(speculative="ngram", num_speculative_tokens=4)):
        assert LLM(dtype="float32", max_model_len=512, **kw).generate([ids], params)[0].outputs[0].token_ids == got
    with pytest.raises(ValueError, match="bad_words .* need a tokenizer"):
        LLM(dtype="float32", skip_tokenizer_init=True).generate([ids], params)


def test_the_models_sampling_defaults_apply_where_no_params_are_given(tmp_path):
    """--generation-config: a folder's generation_config.json (greedy, 5 tokens) is what generate() without
    SamplingParams runs, and get_default_sampling_params() gives it to change; 'vllm' keeps SamplingParams'."""
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 5, "top_k": 7}')
    llm = LLM(dtype="float32", max_model_len=256, generation_config=str(tmp_path))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 5, 7)
    ids = prompt(llm, "Count from one to twenty.")
    out = llm.generate(ids)[0].outputs[0]
    greedy = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids == greedy.token_ids
    llm.llm_engine.shutdown()
    plain = LLM(dtype="float32", max_model_len=256, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_reset_prefix_cache_forgets_the_cached_prompts(llm):
    ids = prompt(llm, "Tell me about the moon and its phases in a few words.")
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first, again = (llm.generate(ids, params)[0] for _ in range(2))
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.reset_prefix_cache()
    after = llm.generate(ids, params)[0]
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == first.outputs[0].token_ids
    llm.llm_engine.kv_cache.check_invariants()
