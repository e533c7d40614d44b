"""The OpenAI-compatible endpoints through the official `openai` client and raw HTTP."""
from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
from serve_helpers import Server

from tokenmill import __version__

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def chat_prompt_tokens(server, messages) -> int:
    r = httpx.post(server.url + "/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_models_health_version(server, client, model_name):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == model_name
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def test_retrieve_model(server, client, model_name):
    """GET /v1/models/{id}, OpenAI's client.models.retrieve, is the entry of /v1/models; it was a 404 "no route"."""
    listed = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert httpx.get(f"{server.url}/v1/models/{model_name}").json() == listed
    assert client.models.retrieve(model_name).model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = httpx.get(server.url + "/v1/models/gpt-4")
    assert r.status_code == 404
    assert r.json()["error"] == {"message": f"the model 'gpt-4' does not exist; this server serves {model_name!r}",
                                 "type": "not_found_error", "param": "model", "code": "model_not_found"}


def test_an_empty_model_name_is_the_served_model(server, client):
    """model "" names the served model, as in vLLM (a client that must send a model sends "" for "any"); it was a
    404 model_not_found."""
    r = client.completions.create(model="", prompt="hi", max_tokens=1)
    assert r.usage.completion_tokens == 1
    r = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=1)
    assert r.usage.completion_tokens == 1
    r = httpx.post(server.url + "/tokenize", json={"model": "", "prompt": "hi"})
    assert r.status_code == 200, r.text


def test_retrieve_a_model_whose_name_is_a_path():
    """A served name from --model is often a path: OpenAI's client sends its / as %2F, other clients as is."""
    server = Server("--max-model-len", "1024", "--served-model-name", "org/tiny-chat")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.models.retrieve("org/tiny-chat").id == "org/tiny-chat"
        assert httpx.get(server.url + "/v1/models/org/tiny-chat").json()["id"] == "org/tiny-chat"
        assert httpx.get(server.url + "/v1/models/org").status_code == 404
    finally:
        server.stop()


@pytest.mark.parametrize("path, status", [("/health", 200), ("/v1/models", 200), ("/v1/models/{model}", 200),
                                          ("/v1/models/gpt-4", 404), ("/version", 200), ("/", 200)])
def test_head_answers_as_get_without_the_body(server, model_name, path, status):
    """Load balancers and uptime checks probe with HEAD, which FastAPI answered with 405 on every GET route."""
    url = server.url + path.format(model=model_name)
    get, head = httpx.get(url), httpx.head(url)
    assert head.status_code == get.status_code == status
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))


def test_head_on_a_post_route_is_405(server):
    r = httpx.head(server.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_developer_message_is_a_system_message(server, client, model_name):
    """OpenAI's newer name for system reaches the chat template as system: SmolLM2's template rendered developer as
    a turn of its own, after its default system prompt."""
    system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    developer = [{"role": "developer", "content": "Be brief."}, *MESSAGES]

    def tokens(messages: list[dict[str, str]]) -> list[int]:
        return httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]

    assert tokens(developer) == tokens(system)
    r = client.chat.completions.create(model=model_name, messages=developer, max_completion_tokens=1)
    assert r.usage.prompt_tokens == len(tokens(system))


def test_chat_non_streaming_exact_usage(server, client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == chat_prompt_tokens(server, MESSAGES)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_streaming_matches_non_streaming(server, client, model_name):
    kwargs = dict(model=model_name, messages=MESSAGES, max_completion_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]  # its prompt_tokens_details may differ: the stream's prompt was cached by the first request
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client, model_name, stream):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: none for a prompt never seen, whole blocks of 16 for
    its repeat (the last prompt token is always computed), in the chat and completion bodies and the last
    streamed chunk, summed over a batch of prompts."""
    text = f"Note {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog. " * 6

    def usage(**kw):
        extra = dict(stream=True, stream_options={"include_usage": True}) if stream else {}
        if "messages" in kw:
            r = client.chat.completions.create(model=model_name, max_completion_tokens=1, **kw, **extra)
        else:
            r = client.completions.create(model=model_name, max_tokens=1, **kw, **extra)
        return list(r)[-1].usage if stream else r.usage

    first = usage(prompt=text)
    again = usage(prompt=text)
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = again.prompt_tokens_details.cached_tokens
    assert cached == (again.prompt_tokens - 1) // 16 * 16 and cached >= 48
    assert usage(prompt=[text, text]).prompt_tokens_details.cached_tokens == 2 * cached
    messages = [{"role": "user", "content": text + " (chat)"}]
    assert usage(messages=messages).prompt_tokens_details.cached_tokens < usage(
        messages=messages).prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats(server, client, model_name, chat):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far (completion
    tokens never fewer than the text streamed so far needs, ending at the choice's count); the last chunk stays
    the request's total. Without include_usage it does nothing."""
    api = client.chat.completions if chat else client.completions
    kwargs = dict(model=model_name, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True})
    kwargs.update(messages=MESSAGES) if chat else kwargs.update(prompt="The capital of France is")
    prompt_len = chat_prompt_tokens(server, MESSAGES) if chat else \
        httpx.post(server.url + "/tokenize", json={"prompt": "The capital of France is"}).json()["count"]
    chunks = list(api.create(**kwargs, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    body, last = chunks[:-1], chunks[-1]
    assert all(c.usage is not None and c.usage.prompt_tokens == prompt_len for c in body)
    counts = [c.usage.completion_tokens for c in body]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage.total_tokens == prompt_len + c.usage.completion_tokens for c in body)
    assert last.choices == [] and last.usage.completion_tokens == 6
    plain = list(api.create(**kwargs, stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)


def test_stream_is_sse_ending_in_done(server, model_name):
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"


def test_completions_non_streaming_and_streaming(server, client, model_name):
    kwargs = dict(model=model_name, prompt="The capital of France is", max_tokens=6, temperature=0)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert full.object == "text_completion"
    assert full.usage.completion_tokens == 6 and full.choices[0].finish_reason == "length"
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": kwargs["prompt"]}).json()
    assert full.usage.prompt_tokens == tokens["count"]
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


def test_completions_batch_and_token_ids(client, model_name):
    r = client.completions.create(model=model_name, prompt=["Hello", "One, two,"], n=2, max_tokens=3,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    r = client.completions.create(model=model_name, prompt=[504, 3458, 314], max_tokens=3,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 3


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_choices_that_end_at_different_steps_finish_once(client, model_name, chat):
    """n > 1 streamed: each choice's finish chunk comes once, and the usage equals the non-streamed request's."""
    kwargs = dict(model=model_name, n=3, max_tokens=40, stop=["e"], seed=1, temperature=1.0)
    api = client.chat.completions if chat else client.completions
    kwargs.update(messages=MESSAGES) if chat else kwargs.update(prompt="Once upon a time")
    full = api.create(**kwargs)
    chunks = list(api.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    finishes = [(c.index, c.finish_reason) for ch in chunks for c in ch.choices if c.finish_reason]
    assert sorted(finishes) == sorted((c.index, c.finish_reason) for c in full.choices)
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len({len(c.message.content if chat else c.text) for c in full.choices}) > 1  # ended at other steps


def test_n_seed_and_extra_sampling_fields(client, model_name):
    kwargs = dict(model=model_name, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=1234, n=3,
                  extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1,
                              "ignore_eos": True})
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs, presence_penalty=0.5, frequency_penalty=0.0, user="tester")
    c = client.chat.completions.create(**kwargs)
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2]
    assert [ch.message.content for ch in a.choices] == [ch.message.content for ch in c.choices]
    assert a.usage.completion_tokens == b.usage.completion_tokens == 24


def test_stop_strings(client, model_name):
    free = client.completions.create(model=model_name, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0)
    text = free.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    r = client.completions.create(model=model_name, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0, stop=[stop])
    assert stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    assert text.startswith(r.choices[0].text)


def test_null_means_the_default(client, model_name):
    """OpenAI's optional fields are nullable, and its client sends a field passed as None as null: such a request
    gets the field's default, as from OpenAI and vLLM, not a 400."""
    nulls = dict(temperature=None, top_p=None, n=None, stream=None, presence_penalty=None, frequency_penalty=None)
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2, logprobs=None, **nulls,
                                       extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.choices[0].logprobs is None and r.usage.completion_tokens == 2
    r = client.completions.create(model=model_name, prompt="Hello", max_tokens=2, echo=None, **nulls,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.usage.completion_tokens == 2


def test_logprobs(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the most likely token
    assert "".join(e.token for e in content) == r.choices[0].message.content
    c = client.completions.create(model=model_name, prompt="Hello", max_tokens=3, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == 0


def test_chat_logprobs_bytes_of_a_character_split_over_tokens(server, client, model_name):
    """"く" is two tokens of the default model, each part of the character: their text is U+FFFD, but their bytes
    (OpenAI's reason for the field) join into the character's UTF-8; they used to be U+FFFD's bytes."""
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "く", "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 2, ids
    entries = []
    for token_id in ids:  # each token forced in turn
        r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=1,
                                           temperature=0, logprobs=True, logit_bias={str(token_id): 100})
        entries.append(r.choices[0].logprobs.content[0])
    assert [e.token for e in entries] == ["\ufffd", "\ufffd"]
    assert b"".join(bytes(e.bytes) for e in entries) == "く".encode()


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs_hold_the_sampled_token(client, model_name, stream):
    """As OpenAI's and vLLM's: each position's top_logprobs has the sampled token beside the k most likely, so
    logprobs=0 gives the sampled token alone; they used to hold the k most likely only."""
    kwargs = dict(model=model_name, prompt="Once upon a time", max_tokens=8, temperature=2.0, seed=7,
                  extra_body={"ignore_eos": True})
    for k in (0, 1):
        r = client.completions.create(**kwargs, logprobs=k, stream=stream)
        lps = [c.choices[0].logprobs for c in r if c.choices] if stream else [r.choices[0].logprobs]
        tokens = [t for lp in lps for t in lp.tokens]
        chosen = [v for lp in lps for v in lp.token_logprobs]
        tops = [top for lp in lps for top in lp.top_logprobs]
        assert len(tokens) == len(tops) == 8
        for token, logprob, top in zip(tokens, chosen, tops):
            assert top[token] == logprob and len(top) <= k + 1
        if k == 1:  # at temperature 2 some sampled token is not the most likely one
            assert any(len(top) == 2 for top in tops)


def one_token(server, text: str) -> int:
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def test_logit_bias_changes_the_greedy_token(server, client, model_name):
    """+100 on a token makes greedy pick it, on both endpoints; -100 on the greedy token makes it pick another."""
    prompt = "The capital of France is"
    free = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0).choices[0].text
    banana = one_token(server, " banana")
    assert free != " banana"
    forced = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(banana): 100})
    assert forced.choices[0].text == " banana"
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=1,
                                          temperature=0, logit_bias={str(banana): 100})
    assert chat.choices[0].message.content == " banana"
    banned = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(one_token(server, free)): -100})
    assert banned.choices[0].text != free


def test_allowed_token_ids_and_truncate_prompt_tokens(server, client, model_name):
    """vLLM's extra fields: the output holds only allowed ids; a truncated prompt counts as its last k tokens in
    usage and gives the text those tokens alone give; -1 keeps what the context holds, 0 and below -1 are 400s."""
    allowed = [one_token(server, w) for w in (" banana", " apple")]
    r = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert set(r.choices[0].text.split()) <= {"banana", "apple"}
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=2,
                                          temperature=0, extra_body={"allowed_token_ids": allowed[:1]})
    assert chat.choices[0].message.content == " banana banana"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "One two three four five six"}).json()["tokens"]
    cut = client.completions.create(model=model_name, prompt="One two three four five six", max_tokens=3,
                                    temperature=0, extra_body={"truncate_prompt_tokens": 3, "ignore_eos": True})
    tail = client.completions.create(model=model_name, prompt=ids[-3:], max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == tail.choices[0].text
    whole = client.completions.create(model=model_name, prompt="One two three four five six", max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1})  # vLLM's: the context length
    assert whole.usage.prompt_tokens == len(ids)
    for k in (0, -2):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "truncate_prompt_tokens": k})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
        assert "must be -1 (the model's context length) or at least 1" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "allowed_token_ids": [10 ** 7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_continue_final_message(server, client, model_name):
    """vLLM's chat fields: the reply goes on with a prefilled assistant message; /tokenize renders the same
    prompt; both with add_generation_prompt is a 400 naming continue_final_message."""
    prefilled = MESSAGES + [{"role": "assistant", "content": "The capital of France is"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    r = client.chat.completions.create(model=model_name, messages=prefilled, max_completion_tokens=3, temperature=0,
                                       extra_body=extra)
    assert r.choices[0].message.content.startswith(" Paris")
    ids = httpx.post(server.url + "/tokenize", json={"messages": prefilled, **extra}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": prefilled, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_bad_words(server, client, model_name):
    """vLLM's bad_words on both endpoints: the free answer's word (as /tokenize spells it) never comes; a word
    of whitespace is a 400 naming bad_words."""
    free = client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=12,
                                          temperature=0).choices[0].message.content
    assert "Paris" in free
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=12, temperature=0,
                                       extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in r.choices[0].message.content and r.choices[0].message.content != free
    for bad, seen in ((None, True), (["Paris"], False)):
        c = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=4,
                                      temperature=0, extra_body={"bad_words": bad})
        assert ("Paris" in c.choices[0].text) == seen, c.choices[0].text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "bad_words": ["ok", "  "]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text
    # spelled on the engine's thread: 25,000 words held every user's decoding for 19 s
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "bad_words": [f"w{i}" for i in range(1025)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words" and "1024" in r.text, r.text
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "allowed_token_ids": [
        one_token(server, "Paris")], "bad_words": ["Paris"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text
    assert "bad_words ban every token of allowed_token_ids" in r.json()["error"]["message"]


def test_chat_template_kwargs(server, client, model_name):
    """vLLM's chat_template_kwargs reach the template (SmolLM2's uses none of them, so the prompt is the same);
    a variable that a field of its own sets is a 400 naming chat_template_kwargs, on chat and /tokenize."""
    plain = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    given = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    assert httpx.post(server.url + "/tokenize", json=given).json()["tokens"] == plain
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=2,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(plain)
    bad = {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}}
    for path in ("/tokenize", "/v1/chat/completions"):
        r = httpx.post(server.url + path, json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert "cannot set add_generation_prompt" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={**bad, "chat_template_kwargs": ["enable_thinking"]})
    assert r.status_code == 400 and "chat_template_kwargs" in r.text, r.text


def test_a_requests_chat_template_is_refused_unless_trusted(server):
    """A chat template is code the server runs: a request's is a 400 naming chat_template on a server started
    without --trust-request-chat-template (vLLM's), on chat and /tokenize."""
    body = {"messages": MESSAGES, "chat_template": "{{ messages[0].content }}"}
    for path in ("/tokenize", "/v1/chat/completions"):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        assert "--trust-request-chat-template" in r.json()["error"]["message"]


def test_chat_template_of_the_server_and_of_a_trusted_request(tmp_path):
    """--chat-template FILE replaces the model's template for every chat; with --trust-request-chat-template a
    request's chat_template replaces it for that request, and an invalid one is a 400 naming chat_template;
    --default-chat-template-kwargs sets template variables a request's chat_template_kwargs may override."""
    (tmp_path / "plain.jinja").write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                                          "{% if add_generation_prompt %}assistant:{% endif %}")
    server = Server("--max-model-len", "1024", "--chat-template", str(tmp_path / "plain.jinja"),
                    "--trust-request-chat-template", "--default-chat-template-kwargs", '{"greeting": "Hello"}')
    try:
        def tokens(body: dict) -> list[int]:
            r = httpx.post(server.url + "/tokenize", json=body)
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        question = MESSAGES[0]["content"]
        assert tokens({"messages": MESSAGES}) == \
            tokens({"prompt": f"user: {question}\nassistant:", "add_special_tokens": False})
        bare = {"messages": MESSAGES, "chat_template": "{{ messages[0].content }}"}
        assert tokens(bare) == tokens({"prompt": question, "add_special_tokens": False})
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES,
                                           max_completion_tokens=2, extra_body={"chat_template": bare["chat_template"]})
        assert r.usage.prompt_tokens == len(tokens(bare))
        # --default-chat-template-kwargs (vLLM's) under a request's own chat_template_kwargs
        greeted = {"messages": MESSAGES, "chat_template": "{{ greeting }} {{ messages[0].content }}"}
        assert tokens(greeted) == tokens({"prompt": f"Hello {question}", "add_special_tokens": False})
        assert tokens({**greeted, "chat_template_kwargs": {"greeting": "Bye"}}) == \
            tokens({"prompt": f"Bye {question}", "add_special_tokens": False})
        r = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES,
                                           max_completion_tokens=2,
                                           extra_body={"chat_template": greeted["chat_template"]})
        assert r.usage.prompt_tokens == len(tokens(greeted))
        for path in ("/tokenize", "/v1/chat/completions"):
            r = httpx.post(server.url + path, json={**bare, "chat_template": "{% for m in messages %}"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
            assert "chat_template is not a valid jinja2 chat template (line 1" in r.json()["error"]["message"]
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_begins_with_the_last_message_of_the_replys_role(client, model_name, stream):
    """vLLM's chat echo: a prefilled assistant message (continue_final_message) comes back before the reply; a
    last message of another role (the user's, with a generation prompt) does not."""
    prefilled = MESSAGES + [{"role": "assistant", "content": "The capital of France is"}]
    kwargs = dict(model=model_name, max_completion_tokens=3, temperature=0, stream=stream)
    cont = {"add_generation_prompt": False, "continue_final_message": True}

    def text(r) -> str:
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream \
            else r.choices[0].message.content

    plain = text(client.chat.completions.create(messages=prefilled, extra_body=cont, **kwargs))
    echoed = text(client.chat.completions.create(messages=prefilled, extra_body={**cont, "echo": True}, **kwargs))
    assert echoed == "The capital of France is" + plain and plain.startswith(" Paris")
    user_last = text(client.chat.completions.create(messages=MESSAGES, extra_body={"echo": True}, **kwargs))
    assert user_last == text(client.chat.completions.create(messages=MESSAGES, **kwargs))


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_returns_the_prompt_first(server, client, model_name, stream):
    """echo: each choice's text starts with its prompt (text as sent; token ids decoded), streamed in the first
    chunk of each choice; the completion after it is the one without echo."""
    kwargs = dict(model=model_name, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "One two three"}).json()["tokens"]
    for prompts, sent in ((["The capital of France is", "Hello"], ["The capital of France is", "Hello"]),
                          (ids, ["One two three"])):
        plain = client.completions.create(prompt=prompts, **kwargs)
        echo = client.completions.create(prompt=prompts, echo=True, stream=stream, **kwargs)
        texts = [""] * len(sent)
        for part in (echo if stream else [echo]):
            for c in part.choices:
                texts[c.index] += c.text
        assert texts == [sent[c.index] + c.text for c in sorted(plain.choices, key=lambda c: c.index)]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_with_logprobs_scores_the_prompt(server, client, model_name, stream):
    """echo with logprobs (how lm-evaluation-harness scores a text): the prompt's tokens come first, the first
    with no logprob, each other with its logprob under the model (the engine's prompt logprobs) and its top
    alternatives; then the completion's, as without echo; text offsets run over the whole returned text."""
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    kwargs = dict(model=model_name, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].logprobs
    r = client.completions.create(**kwargs, echo=True, stream=stream)
    parts = [c.choices[0].logprobs for c in r if c.choices] if stream else [r.choices[0].logprobs]
    tokens = [t for p in parts for t in p.tokens]
    chosen = [v for p in parts for v in p.token_logprobs]
    tops = [t for p in parts for t in p.top_logprobs]
    offsets = [o for p in parts for o in p.text_offset]
    n = len(ids)
    assert len(tokens) == n + 3 and tokens[n:] == plain.tokens
    assert chosen[0] is None and tops[0] is None and all(v < 0 for v in chosen[1:n])
    assert chosen[n:] == pytest.approx(plain.token_logprobs, abs=1e-4)
    for token, logprob, top in zip(tokens[1:], chosen[1:], tops[1:]):
        assert top[token] == logprob and len(top) <= 3
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    # the prompt's logprobs are those of prompt_logprobs (vLLM's field) and of the Python API
    extra = client.completions.create(model=model_name, prompt=prompt, max_tokens=1,
                                      extra_body={"prompt_logprobs": 2}).choices[0].prompt_logprobs
    assert extra[0] is None and len(extra) == n
    for i in range(1, n):
        entry = extra[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(chosen[i], abs=1e-4) and entry["rank"] >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_with_max_tokens_0_returns_the_prompt_alone(server, client, model_name, stream):
    """echo with max_tokens 0 (OpenAI's legacy way to score a text, vLLM's too): each choice is its prompt and the
    prompt's logprobs, nothing generated, ended by length; without echo 0 tokens is still refused."""
    prompt = "The capital of France is"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    scored = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, echo=True, logprobs=1)
    kwargs = dict(stream_options={"include_usage": True}) if stream else {}
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=0, echo=True, logprobs=1, n=2,
                                  stream=stream, **kwargs)
    parts = list(r) if stream else [r]
    for index in (0, 1):
        choices = [c for p in parts for c in p.choices if c.index == index]
        assert "".join(c.text for c in choices) == prompt
        assert [c.finish_reason for c in choices][-1] == "length"
        tokens = [t for c in choices for t in c.logprobs.tokens]
        assert len(tokens) == len(ids) and tokens == scored.choices[0].logprobs.tokens[:len(ids)]
        assert [v for c in choices for v in c.logprobs.token_logprobs] == pytest.approx(
            scored.choices[0].logprobs.token_logprobs[:len(ids)], abs=1e-4)
    usage = parts[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 0, len(ids))
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_prompt_logprobs_entries(server, client, model_name):
    """vLLM's prompt_logprobs: per prompt position (None first) the prompt token's logprob, rank and text, and
    the k likeliest tokens with ranks 1..k; on chat completions at the response's top level."""
    prompt = "One two three four"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for i, e in enumerate(entries[1:], 1):
        mine = e[str(ids[i])]
        assert mine["decoded_token"] == httpx.post(server.url + "/detokenize", json={"tokens": [ids[i]]}).json()[
            "prompt"]
        ranked = sorted(e.values(), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked][:3] == [1, 2, 3]
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(ranked, ranked[1:]))
        assert len(e) == (3 if mine["rank"] <= 3 else 4)  # the prompt token is one of the 3, or a 4th entry
    assert "prompt_logprobs" in r.json()["choices"][0]
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1,
                                                                 "prompt_logprobs": 0}).json()
    n = chat["usage"]["prompt_tokens"]
    assert len(chat["prompt_logprobs"]) == n and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in chat["prompt_logprobs"][1:])
    plain = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert plain["prompt_logprobs"] is None


def test_tokenize_detokenize_roundtrip(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 1024
    d = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d == {"prompt": "Hello world"}


def test_tokenize_returns_token_strs_on_request(server):
    """vLLM's return_token_strs: each token's string in the vocabulary beside its id (byte-level BPE's, "Ġ" for a
    space), for a prompt and for chat messages; without it, token_strs is null. It was ignored."""
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["token_strs"] == ["Hello", "Ġworld"] and r["count"] == len(r["tokens"]) == 2
    assert httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()["token_strs"] is None
    messages = [{"role": "user", "content": "Hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    assert len(r["token_strs"]) == r["count"] and "<|im_start|>" in r["token_strs"]


def test_chat_prompt_round_trips_through_tokenize_and_detokenize(server):
    """/detokenize keeps special tokens, as vLLM's does: the ids of a chat prompt come back as the rendered chat
    template, role markers included, and that text tokenizes to the same ids."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    again = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert again["tokens"] == ids


def test_openapi_schema(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    paths = schema["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize",
                 "/detokenize", "/version"):
        assert path in paths
    schemas = schema["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    for field in ("messages", "stream", "stream_options", "n", "stop", "seed", "logprobs", "top_logprobs", "max_tokens",
                  "max_completion_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty", "user",
                  "top_k", "min_p", "repetition_penalty", "ignore_eos", "priority", "logit_bias", "response_format",
                  "tools", "tool_choice", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
                  "skip_special_tokens", "guided_json", "structured_outputs"):
        assert field in chat, field
    assert chat["temperature"]["maximum"] == 2.0
    assert "ChatCompletionChunk" in schemas and "ErrorResponse" in schemas
    post = paths["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(post)
    assert "text/event-stream" in post["200"]["content"]


def test_web_ui_served(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "<title>tokenmill</title>" in page.text
    assert httpx.get(server.url + "/static/ui.js").status_code == 200
    stats = httpx.get(server.url + "/stats").json()
    assert {"model", "stats", "points"} <= set(stats)


METRIC_NAMES = [
    "tokenmill:time_to_first_token_seconds_bucket", "tokenmill:request_time_per_output_token_seconds_bucket",
    "tokenmill:inter_token_latency_seconds_bucket", "tokenmill:e2e_request_latency_seconds_bucket",
    "tokenmill:request_queue_time_seconds_bucket", "tokenmill:request_prefill_time_seconds_bucket",
    "tokenmill:request_decode_time_seconds_bucket", "tokenmill:num_requests_running",
    "tokenmill:num_requests_waiting", "tokenmill:kv_cache_usage_perc", "tokenmill:kv_cache_used_tokens",
    "tokenmill:kv_cache_block_utilization", "tokenmill:prompt_tokens_total", "tokenmill:generation_tokens_total",
    "tokenmill:prefix_cache_queries_total", "tokenmill:prefix_cache_hits_total", "tokenmill:num_preemptions_total",
    "tokenmill:request_abort_total", "tokenmill:request_rejected_total", "tokenmill:oom_total",
    "tokenmill:batch_size_prefill_bucket", "tokenmill:batch_size_decode_bucket", "tokenmill:request_success_total"]


def test_metric_names(server, client, model_name):
    client.completions.create(model=model_name, prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
    names = {k.split("{")[0] for k in server.metrics()}
    assert [n for n in METRIC_NAMES if n not in names] == []


def test_metrics_count_tokens(server, client, model_name):
    before = server.metric("tokenmill:generation_tokens_total")
    done = server.metric("tokenmill:request_success_total", finished_reason="length")
    client.completions.create(model=model_name, prompt="Hi there", max_tokens=5, extra_body={"ignore_eos": True})
    assert server.metric("tokenmill:generation_tokens_total") == before + 5
    assert server.metric("tokenmill:request_success_total", finished_reason="length") == done + 1
    assert server.metric("tokenmill:num_requests_running") == 0


BANANA = 21285  # " banana", one token of the default model
IM_START = 1    # "<|im_start|>", a special token that is not EOS


@pytest.mark.parametrize("chat", [False, True])
def test_min_tokens_keeps_generating_past_eos(client, model_name, chat):
    """EOS forced by logit_bias ends the output at once, unless min_tokens holds it off; then it ends right after."""
    api = client.chat.completions if chat else client.completions
    kwargs = dict(model=model_name, max_tokens=8, temperature=0, logit_bias={"2": 100})  # 2: <|im_end|>, EOS
    kwargs.update(messages=MESSAGES) if chat else kwargs.update(prompt="Hello")
    assert api.create(**kwargs).usage.completion_tokens == 1
    r = api.create(**kwargs, extra_body={"min_tokens": 3})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("chat", [False, True])
def test_stop_token_ids_and_include_stop_str_in_output(client, model_name, chat):
    """A stop token id ends the output, its text left out unless include_stop_str_in_output, as vLLM's."""
    api = client.chat.completions if chat else client.completions
    kwargs = dict(model=model_name, max_tokens=3, temperature=0, logit_bias={str(BANANA): 100})
    kwargs.update(messages=MESSAGES) if chat else kwargs.update(prompt="Hello")

    def text(r) -> str:
        return r.choices[0].message.content if chat else r.choices[0].text

    r = api.create(**kwargs, extra_body={"stop_token_ids": [BANANA]})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop" and text(r) == ""
    r = api.create(**kwargs, extra_body={"stop_token_ids": [BANANA], "include_stop_str_in_output": True})
    assert r.usage.completion_tokens == 1 and text(r) == " banana"
    r = api.create(**kwargs, stop=["nana"], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].finish_reason == "stop" and text(r) == " banana"


@pytest.mark.parametrize("chat", [False, True])
def test_skip_special_tokens_false_keeps_them_in_the_text(client, model_name, chat):
    """A special token that is not EOS is generated but left out of the text, unless skip_special_tokens=false."""
    api = client.chat.completions if chat else client.completions
    kwargs = dict(model=model_name, max_tokens=2, temperature=0, logit_bias={str(IM_START): 100})
    kwargs.update(messages=MESSAGES) if chat else kwargs.update(prompt="Hello")
    skipped = api.create(**kwargs)
    kept = api.create(**kwargs, extra_body={"skip_special_tokens": False})
    assert (skipped.choices[0].message.content if chat else skipped.choices[0].text) == ""
    assert (kept.choices[0].message.content if chat else kept.choices[0].text) == "<|im_start|><|im_start|>"


@pytest.fixture(scope="module")
def bos_server(tmp_path_factory):
    """The default model with a tokenizer that adds a BOS (a Llama 2 GGUF's, add_bos_token on; its chat template
    begins with the BOS too): SmolLM2's adds none, so add_special_tokens changes nothing there."""
    from test_tokenizer import write_sentencepiece_gguf
    s = Server("--tokenizer", write_sentencepiece_gguf(tmp_path_factory.mktemp("bos") / "sp.gguf", True),
               "--max-model-len", "512")
    yield s
    s.stop()


def test_add_special_tokens(bos_server):
    """vLLM's add_special_tokens: on by default for a text prompt (completions, /tokenize), off for a chat, whose
    template holds the BOS; either way as asked (it was ignored on completions and chat)."""
    def prompt_tokens(path: str, body: dict, add: bool | None) -> int:
        extra = {} if add is None else {"add_special_tokens": add}
        r = httpx.post(bos_server.url + path, json={**body, **extra, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"] if path.startswith("/v1") else r.json()["count"]
    prompt, chat = {"prompt": "the cat"}, {"messages": [{"role": "user", "content": "the cat"}]}
    for path, body, default in (("/v1/completions", prompt, True), ("/tokenize", prompt, True),
                                ("/v1/chat/completions", chat, False), ("/tokenize", chat, False)):
        with_bos, without = prompt_tokens(path, body, True), prompt_tokens(path, body, False)
        assert with_bos == without + 1, (path, body)
        assert prompt_tokens(path, body, None) == (with_bos if default else without), (path, body)
    r = httpx.post(bos_server.url + "/tokenize", json={**prompt, "add_special_tokens": False})
    assert r.json()["tokens"][0] != 1  # no BOS
