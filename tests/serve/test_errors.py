"""Bad input gets a clear error in OpenAI's shape, and nothing else breaks: no 500s, the engine loop lives on."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest
from serve_helpers import Server

CHAT = "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=60, **kwargs)


def assert_error(r: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and contains in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("body, param", [
    ("{not json", None),
    ("", None),
    ("[1, 2]", None),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": OK_MESSAGES, "temperature": "hot"}, "temperature"),
    ({"messages": OK_MESSAGES, "temperature": 2.5}, "temperature"),
    ({"messages": OK_MESSAGES, "top_p": 0}, "top_p"),
    ({"messages": OK_MESSAGES, "n": 0}, "n"),
    ({"messages": OK_MESSAGES, "n": True}, "n"),
    ({"messages": OK_MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"messages": OK_MESSAGES, "max_tokens": "8"}, "max_tokens"),
    ({"messages": OK_MESSAGES, "max_tokens": 2000}, "max_tokens"),
    ({"messages": OK_MESSAGES, "max_completion_tokens": 2000}, "max_completion_tokens"),  # names the field sent
    ({"messages": OK_MESSAGES, "seed": -1}, "seed"),
    ({"messages": OK_MESSAGES, "stop": 5}, "stop"),
    ({"messages": OK_MESSAGES, "stop": [""]}, "stop"),
    ({"messages": OK_MESSAGES, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({"messages": OK_MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": OK_MESSAGES, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": OK_MESSAGES, "top_k": -5}, "top_k"),
    ({"messages": OK_MESSAGES, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": OK_MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": OK_MESSAGES, "timeout_s": -1}, "timeout_s"),
    ({"messages": OK_MESSAGES, "priority": 10 ** 400}, "priority"),
    ({"messages": OK_MESSAGES, "stop": ["x"] * 1025}, "stop"),
    ({"messages": OK_MESSAGES, "logit_bias": [1]}, "logit_bias"),
    ({"messages": OK_MESSAGES, "logit_bias": {"hello": 1}}, "logit_bias"),
    ({"messages": OK_MESSAGES, "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"messages": OK_MESSAGES, "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"messages": OK_MESSAGES, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": OK_MESSAGES, "logit_bias": {"5": "up"}}, "logit_bias"),
    ({"messages": OK_MESSAGES, "min_tokens": -1}, "min_tokens"),
    ({"messages": OK_MESSAGES, "min_tokens": "2"}, "min_tokens"),
    ({"messages": OK_MESSAGES, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"messages": OK_MESSAGES, "stop_token_ids": 5}, "stop_token_ids"),
    ({"messages": OK_MESSAGES, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"messages": OK_MESSAGES, "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"messages": OK_MESSAGES, "skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"messages": [{"role": "user", "content": "a lone \ud800 surrogate"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, "messages.0.content.0.text"),
])
def test_bad_chat_requests_are_400(server, body, param):
    assert_error(post(server, CHAT, body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": "hi", "max_tokens": 2000}, "max_tokens"),
    ({"prompt": "hi \ud800 there"}, "prompt"),
    ({"prompt": "hi", "stop": ["\udfff"]}, "stop.0"),
    ({"prompt": "hi", "logit_bias": {"5": float("nan")}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"100000000": 1}}, "logit_bias"),
    ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids.0"),
    ({"prompt": "hi", "stop_token_ids": [5] * 1025}, "stop_token_ids"),  # over MAX_STOP_TOKEN_IDS
])
def test_bad_completion_requests_are_400(server, body, param):
    assert_error(post(server, "/v1/completions", json.dumps(body, allow_nan=True)), 400, param)


@pytest.mark.parametrize("body, param, contains", [
    ({"tokens": [-1]}, "tokens", "token ids must be in [0, "),
    ({"tokens": [49152]}, "tokens", "got [49152]"),                      # one past the vocabulary
    ({"tokens": [10 ** 30]}, "tokens", "token ids must be in [0, "),     # the tokenizer's OverflowError
    ({"tokens": [5] * 1_000_000 + [-7]}, "tokens", "got [-7]"),          # one bad id at the end of a long list
    ({"tokens": [1.0]}, "tokens.0", "integer"),
    ({"tokens": None}, "tokens", "list"),
    ({}, "tokens", "required"),
])
def test_bad_detokenize_requests_are_400(server, body, param, contains):
    assert_error(post(server, "/detokenize", body), 400, param, contains)


@pytest.mark.parametrize("body, param, contains", [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": "hi"}, "messages", "list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "'user'"),
    ({"prompt": "hi", "add_special_tokens": 1}, "add_special_tokens", "boolean"),
    ({"prompt": 5}, "prompt", "string"),
    ({"prompt": "a lone \ud800"}, "prompt", "lone surrogate"),
    ({}, "prompt", "required"),
])
def test_bad_tokenize_requests_are_400_about_the_request_they_meant(server, body, param, contains):
    """A body with messages is a chat request, any other a prompt: the error is about that request alone, not
    also "prompt: Field required" beside a problem with the messages (or the reverse)."""
    err = assert_error(post(server, "/tokenize", body), 400, param, contains)
    assert ("prompt" if "messages" in body else "messages") not in err["message"], err


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("chat, field, kwargs", [
    (True, "response_format", dict(response_format={"type": "json_object"})),
    (True, "response_format", dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}})),
    (True, "tools", dict(tools=[TOOL])),
    (True, "tool_choice", dict(tool_choice="auto")),
    (True, "tool_choice", dict(tool_choice={"type": "function", "function": {"name": "f"}})),
    (True, "functions", dict(functions=[TOOL["function"]])),
    (True, "function_call", dict(function_call="auto")),
    (True, "prompt_logprobs", dict(extra_body={"prompt_logprobs": 1}, stream=True)),
    (False, "suffix", dict(suffix="!")),
    (False, "best_of", dict(best_of=2)),
    (False, "response_format", dict(extra_body={"response_format": {"type": "json_object"}}, stream=True)),
    (False, "prompt_logprobs", dict(extra_body={"prompt_logprobs": 0}, stream=True)),
    (True, "guided_json", dict(extra_body={"guided_json": {"type": "object"}})),
    (True, "guided_regex", dict(extra_body={"guided_regex": "[0-9]+"})),
    (True, "guided_choice", dict(extra_body={"guided_choice": ["yes", "no"]})),
    (True, "guided_grammar", dict(extra_body={"guided_grammar": 'root ::= "a"'})),
    (True, "structured_outputs", dict(extra_body={"structured_outputs": {"choice": ["yes", "no"]}})),
    (True, "use_beam_search", dict(extra_body={"use_beam_search": True})),
    (False, "use_beam_search", dict(extra_body={"use_beam_search": True}, stream=True)),
    (True, "return_tokens_as_token_ids", dict(logprobs=True, extra_body={"return_tokens_as_token_ids": True})),
    (False, "return_tokens_as_token_ids", dict(logprobs=1, extra_body={"return_tokens_as_token_ids": True})),
    (True, "return_token_ids", dict(extra_body={"return_token_ids": True}, stream=True)),
    (False, "return_token_ids", dict(extra_body={"return_token_ids": True})),
    (False, "guided_json", dict(extra_body={"guided_json": '{"type": "object"}'})),
    (False, "guided_regex", dict(extra_body={"guided_regex": "[0-9]+"})),
    (False, "guided_choice", dict(extra_body={"guided_choice": []})),
    (False, "guided_grammar", dict(extra_body={"guided_grammar": 'root ::= "a"'})),
    (False, "structured_outputs", dict(extra_body={"structured_outputs": {}}, stream=True)),
])
def test_unsupported_fields_are_refused_by_name(client, model_name, chat, field, kwargs):
    """OpenAI and vLLM fields that tokenmill does not implement are a 400 naming the field, not ignored."""
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            client.chat.completions.create(model=model_name, messages=OK_MESSAGES, max_tokens=2, **kwargs)
        else:
            client.completions.create(model=model_name, prompt="hi", max_tokens=2, **kwargs)
    err = e.value.body
    assert err["param"] == field and err["code"] == "unsupported_parameter", err
    assert err["message"].startswith(field) and "not supported" in err["message"], err


def test_unsupported_fields_at_their_neutral_values_are_accepted(client, model_name):
    """What asks for nothing beyond plain text is no reason to refuse a request."""
    r = client.chat.completions.create(model=model_name, messages=OK_MESSAGES, max_tokens=2,
                                       response_format={"type": "text"}, tools=[], tool_choice="none",
                                       function_call="none",
                                       extra_body={"echo": False, "ignore_eos": True, "guided_json": None,
                                                   "structured_outputs": None, "use_beam_search": False,
                                                   "return_tokens_as_token_ids": False, "return_token_ids": False})
    assert r.usage.completion_tokens == 2
    r = client.completions.create(model=model_name, prompt="hi", max_tokens=2, n=2, best_of=2, echo=False,
                                  extra_body={"ignore_eos": True, "some_unknown_field": 1})
    assert r.usage.completion_tokens == 4


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop", "stop: must be a string or a list of strings, got 5"),
    ("/v1/completions", {"prompt": 5.5}, "prompt", "prompt: must be a string or a list of strings or a list of "
                                                   "integers or a list of lists of integers, got 5.5"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     'messages.0.content: must be a string or a list of text parts {"type": "text", "text": ...}, got 5'),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0.type",
     "messages.0.content.0.type: Input should be 'text'"),  # a list: the error inside it, not "not a string"
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 1025}, "stop", "at most 1024 items"),
])
def test_a_value_of_no_allowed_type_lists_the_types(server, path, body, param, message):
    """A union's members each failed on their own, and the first ("Input should be a valid string") read as if a
    string were the only thing allowed."""
    err = assert_error(post(server, path, body), 400, param, message)
    assert "valid string" not in err["message"], err


def test_prompt_longer_than_context_names_both_lengths(server):
    n = httpx.post(server.url + "/tokenize", json={"prompt": "hello " * 1500}).json()["count"]
    err = assert_error(post(server, "/v1/completions", {"prompt": "hello " * 1500}), 400, "prompt", "1024")
    assert err["code"] == "context_length_exceeded" and f"{n} tokens" in err["message"]
    r = post(server, CHAT, {"messages": [{"role": "user", "content": "hello " * 1500}]})
    assert "1024" in assert_error(r, 400, "messages")["message"]


def test_text_that_cannot_fit_is_refused_before_tokenizing(server):
    """A text whose UTF-8 size over 4 x the longest token (81 bytes) already exceeds the context is refused without
    being tokenized, saying how many tokens it has at least; /tokenize still counts it, and with
    truncate_prompt_tokens (which keeps its end) it runs."""
    text = "hello world " * 40000  # 480,000 bytes: at least 1481 tokens of at most 81 bytes, with the slack of 4
    err = assert_error(post(server, "/v1/completions", {"prompt": text}), 400, "prompt", "at least 1481")
    assert err["code"] == "context_length_exceeded" and "1024" in err["message"], err
    r = post(server, CHAT, {"messages": [{"role": "user", "content": text}]})
    assert "at least" in assert_error(r, 400, "messages")["message"]
    assert httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=60).json()["count"] >= 1481
    r = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8, r.text


def test_unknown_model_and_path_are_404(server, client):
    assert_error(post(server, CHAT, {"model": "gpt-4", "messages": OK_MESSAGES}), 404, "model", "gpt-4")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=OK_MESSAGES)
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)
    assert_error(httpx.get(server.url + CHAT), 405)


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": OK_MESSAGES, "max_tokens": 1}),
                                        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                                        ("/tokenize", {"prompt": "hi"})])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_body_not_sent_as_json_names_its_content_type(server, path, body, content_type):
    """`curl -d` sends JSON as a form: the 400 names the Content-Type and the one expected; it said only "must be
    a JSON object". The same body without a Content-Type is read as JSON."""
    body = json.dumps(body)
    r = httpx.post(server.url + path, content=body, headers={"content-type": content_type}, timeout=60)
    err = assert_error(r, 400, None, f"got Content-Type: {content_type}")
    assert "application/json" in err["message"] and err["code"] == "invalid_body", err
    r = httpx.post(server.url + path, content=body, timeout=60)
    assert "content-type" not in r.request.headers and r.status_code == 200, r.text
    err = assert_error(post(server, path, "[1, 2]"), 400, None, "must be a JSON object")
    assert "Content-Type" not in err["message"]


@pytest.mark.parametrize("body", [
    '{"prompt": "caf\xe9"}'.encode("latin-1"),     # not UTF-8
    "[" * 2000 + "]" * 2000,                         # deeper than the JSON parser's recursion limit
    '{"max_tokens": ' + "9" * 5000 + "}",            # past Python's limit on integer digits
])
def test_unreadable_body_is_invalid_json_saying_what_is_taken(server, body):
    """Bodies the JSON parser cannot read at all were FastAPI's "There was an error parsing the body", code null."""
    err = assert_error(post(server, "/v1/completions", body), 400, None, "UTF-8 JSON")
    assert err["code"] == "invalid_json", err


def test_openai_client_raises_bad_request(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[], max_tokens=4)
    assert e.value.body["param"] == "messages"


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("top_p", float("inf")),
                                          ("timeout_s", float("inf")), ("presence_penalty", float("-inf"))])
def test_non_finite_numbers_are_named(server, field, value):
    """NaN used to be reported against the field's bounds ("less than or equal to 2"); timeout_s took Infinity."""
    body = {"prompt": "hi", "max_tokens": 2, field: value}
    assert_error(post(server, "/v1/completions", json.dumps(body, allow_nan=True)), 400, field,
                 "Input should be a finite number")


def test_random_garbage_never_500(server):
    rng = random.Random(0)
    fields = ["messages", "prompt", "model", "n", "temperature", "top_p", "max_tokens", "stop", "seed", "stream",
              "logprobs", "top_logprobs", "stream_options", "top_k", "priority", "ignore_eos", "timeout_s",
              "logit_bias", "response_format", "tools", "tool_choice", "echo", "best_of"]
    values = [None, 0, -1, 1.5, 10 ** 30, "", "x", [], [1], [[1, 2]], {}, {"role": "user"}, True, "\u0000", [None],
              [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], float("nan")]
    for _ in range(60):
        body = {k: rng.choice(values) for k in rng.sample(fields, rng.randint(1, 6))}
        for path in (CHAT, "/v1/completions", "/tokenize", "/detokenize"):
            r = post(server, path, json.dumps(body, allow_nan=True))
            assert r.status_code < 500, (path, body, r.text)
            if r.status_code >= 400:
                assert "error" in r.json()
    for raw in (b"\xff\xfe", b"{" * 10000, b"null", b"1e999999", b'{"messages": [' + b"[" * 5000 + b"]"):
        assert post(server, CHAT, raw).status_code < 500
    assert httpx.get(server.url + "/health").status_code == 200


def test_engine_survives_errors(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=OK_MESSAGES, max_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


# ---- a server with an API key, a small body limit and a tiny queue ----------------------------------------
@pytest.fixture(scope="module")
def strict_server():
    s = Server("--max-model-len", "1024", "--api-key", "sesame", "--max-request-bytes", "4096",
               "--max-num-seqs", "1", "--max-queue-len", "1", "--kv-cache-tokens", "512",
               "--allowed-origins", "http://app.example")
    yield s
    s.stop()


def test_api_key(strict_server):
    body = {"messages": OK_MESSAGES, "max_tokens": 2}
    assert_error(post(strict_server, CHAT, body), 401)
    r = httpx.post(strict_server.url + CHAT, json=body, headers={"Authorization": "Bearer wrong"})
    assert_error(r, 401)
    assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict_server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=strict_server.url + "/v1", api_key="sesame", max_retries=0)
    assert good.chat.completions.create(model=good.models.list().data[0].id, messages=OK_MESSAGES,
                                        max_tokens=2).choices
    assert httpx.get(strict_server.url + "/health").status_code == 200  # outside /v1: open


def test_cors_for_allowed_origins_only(server, strict_server):
    """--allowed-origins (vLLM's): a browser's preflight from an allowed origin is answered before the API key is
    checked (it carries none), and the answer to the request itself names the origin; another origin gets no
    CORS headers, and neither does any origin of a server without the flag (its preflight is a 405)."""
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(strict_server.url + CHAT, headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example", r.text
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.get(strict_server.url + "/v1/models", headers={"Origin": "http://app.example",
                                                              "Authorization": "Bearer sesame"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.options(strict_server.url + CHAT, headers={**preflight, "Origin": "http://other.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(server.url + CHAT, headers=preflight)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in httpx.get(server.url + "/v1/models",
                                                          headers={"Origin": "http://app.example"}).headers


def test_oversized_body_is_413(strict_server):
    headers = {"Authorization": "Bearer sesame"}
    body = {"messages": [{"role": "user", "content": "x" * 5000}]}
    assert_error(httpx.post(strict_server.url + CHAT, json=body, headers=headers), 413, None, "4096")

    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'
    assert_error(httpx.post(strict_server.url + CHAT, content=chunks(), headers=headers), 413)


def test_default_max_tokens_fits_a_kv_cache_smaller_than_the_context(strict_server):
    """512 tokens of KV cache under a 1024-token context: a request without max_tokens may grow to what the cache
    holds (not refused for a max_tokens the user never sent)."""
    client = openai.OpenAI(base_url=strict_server.url + "/v1", api_key="sesame", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=OK_MESSAGES, stop=["."])
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.total_tokens <= 512


def test_request_longer_than_the_kv_cache_names_the_cache(strict_server):
    """Within the 1024-token context but past the 512 tokens the cache holds: the error says so and names what
    to change (it used to name kv_cache_memory, an engine option, with param null)."""
    headers = {"Authorization": "Bearer sesame"}
    for body, param in (({"prompt": [1] * 600}, "prompt"), ({"prompt": [1] * 100, "max_tokens": 500}, "max_tokens")):
        r = httpx.post(strict_server.url + "/v1/completions", json=body, headers=headers, timeout=60)
        err = assert_error(r, 400, param, "KV cache holds at most 512 tokens of one request")
        assert err["code"] == "context_length_exceeded"


def test_full_queue_is_429_with_retry_after(strict_server):
    headers = {"Authorization": "Bearer sesame"}
    body = {"messages": OK_MESSAGES, "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=strict_server.url, headers=headers, timeout=60) as c:
            async with c.stream("POST", CHAT, json=body) as running:    # takes the only running slot
                assert running.status_code == 200
                lines = running.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                async with c.stream("POST", CHAT, json=body) as waiting:  # fills the queue of one
                    assert waiting.status_code == 200
                    return await c.post(CHAT, json=body)

    r = asyncio.run(scenario())
    err = assert_error(r, 429)
    assert err["type"] == "rate_limit_error"
    assert int(r.headers["retry-after"]) >= 1
    assert strict_server.metric("tokenmill:request_rejected_total", reason="queue_full") >= 1


def test_a_batch_that_never_fits_the_queue_is_400_not_429(strict_server):
    """Two prompts (or n=2) against a queue of one: a retry could never make room, so no Retry-After."""
    headers = {"Authorization": "Bearer sesame"}
    for body, param in (({"prompt": ["a", "b"], "max_tokens": 1}, "prompt"), ({"prompt": "a", "n": 2}, "n")):
        r = httpx.post(strict_server.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert_error(r, 400, param, "more than the waiting queue holds (1, --max-queue-len)")
        assert "retry-after" not in r.headers


def test_priority_without_priority_scheduling_is_refused(server):
    """As vLLM: a priority the FCFS scheduler would ignore is an error, not silently dropped."""
    body = {"prompt": "hi", "max_tokens": 1, "priority": 5}
    assert_error(post(server, "/v1/completions", body), 400, "priority", "priority scheduling is not enabled")
    assert post(server, "/v1/completions", {**body, "priority": 0}).status_code == 200
