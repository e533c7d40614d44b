"""Speculative decoding on the real default model: greedy output identical to plain decoding on input-grounded
and chat prompts, and stop strings found inside a run of accepted tokens end the output where plain decoding
does."""
import pytest

from tokenmill import LLM, SamplingParams

PASSAGE = ("The lighthouse stood at the edge of the cliff for two hundred years. Every night its keeper climbed "
           "the narrow stairs, trimmed the wick and watched the ships pass safely through the strait.")
PROMPTS = [f"Repeat this text word for word: {PASSAGE}",
           f"Summarize in one sentence: {PASSAGE}",
           "What is the capital of France?",
           "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def plain():
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def prompt_ids(plain):
    tok = plain.get_tokenizer()
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in PROMPTS]


def test_greedy_identical_on_the_default_model(plain, prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=40)
    want = [o.outputs[0].token_ids for o in plain.generate(prompt_ids, params)]
    spec = LLM(dtype="float32", speculative="ngram", num_speculative_tokens=4)
    got = [o.outputs[0].token_ids for o in spec.generate(prompt_ids, params)]
    assert got == want
    stats = spec.llm_engine.get_stats()
    assert stats["spec_num_accepted_tokens"] > 10 and stats["spec_mean_accepted_length"] > 1.5


def test_stop_string_inside_accepted_tokens(plain, prompt_ids):
    ref = plain.generate(prompt_ids[0], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    stop = ref[ref.index("keeper"):][:len("keeper climbed")]
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    want = plain.generate(prompt_ids[0], params)[0].outputs[0]
    engine = LLM(dtype="float32", speculative="ngram", num_speculative_tokens=6).llm_engine
    engine.spec.adaptive = False
    engine.add_request("a", prompt_ids[0], params)
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for o in engine.step():
            streamed += o.outputs[0].delta_text
            final = o.outputs[0]
    assert final.text == want.text == streamed and stop not in final.text
    assert final.token_ids == want.token_ids and final.finish_reason == want.finish_reason == "stop"


def test_greedy_identical_on_the_cpu_fast_path(prompt_ids):
    """bf16 over the GGUF's packed INT4 weights: verification rows attend exactly as decode rows do, so even where
    bf16 rounding makes near-ties, speculative greedy output is plain greedy output (the chat-style prompts
    here flipped a token before verification went row by row)."""
    fast = dict(dtype="bfloat16", quantization="gguf", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=64)
    want = [o.outputs[0].token_ids for o in LLM(**fast).generate(prompt_ids, params)]
    got = [o.outputs[0].token_ids for o in LLM(**fast, speculative="ngram", num_speculative_tokens=4)
           .generate(prompt_ids, params)]
    assert got == want
