"""OpenAI's Responses API (POST /v1/responses) through the official client and raw HTTP: the same conversation
gives the same greedy text and token counts as chat completions, streaming sends OpenAI's typed events in order,
and what tokenmill does not implement is refused by name."""
from __future__ import annotations

import json
import random
import uuid

import httpx
import openai
import pytest
from openai.types.responses import Response
from serve_helpers import Server, wait_until

QUESTION = "What is the capital of France?"
GREEDY = dict(temperature=0, max_output_tokens=12)
EVENTS_IN_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                   "response.content_part.added"]
EVENTS_AT_THE_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def post(server, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + "/v1/responses", content=content, headers={"content-type": "application/json"},
                      timeout=60)


def sse(server, body: dict) -> list[tuple[str, dict]]:
    """(the event line's name, the data) of each event of a raw stream; the stream must hold nothing else."""
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().split("\n\n")
    assert blocks[-1] == ""
    events = []
    for block in blocks[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        events.append((name[7:], json.loads(data[6:])))
    return events


def chat_twin(client, model_name, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(model=model_name, messages=messages, temperature=0,
                                          max_completion_tokens=max_tokens)


def test_string_input_is_a_user_message(server, client, model_name):
    """Greedy, the response is the chat completion of the same conversation: text, token counts, and finish."""
    r = client.responses.create(model=model_name, input=QUESTION, **GREEDY, metadata={"run": "1"}, user="tester")
    chat = chat_twin(client, model_name, [{"role": "user", "content": QUESTION}], 12)
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model_name
    message = r.output[0]
    assert len(r.output) == 1 and message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == r.status
    assert [(c.type, c.annotations) for c in message.content] == [("output_text", [])]
    assert (r.temperature, r.top_p, r.max_output_tokens, r.metadata, r.user) == (0, 1.0, 12, {"run": "1"}, "tester")
    assert (r.tools, r.tool_choice, r.text.format.type, r.error, r.instructions) == ([], "auto", "text", None, None)


def test_the_body_is_openais_response_object(server, model_name):
    """Strictly validated against the client's own model (the client itself parses leniently)."""
    r = post(server, {"model": "", "input": QUESTION, "max_output_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = Response.model_validate(r.json())
    assert body.status == "incomplete" and body.incomplete_details.reason == "max_output_tokens"
    assert body.usage.output_tokens_details.reasoning_tokens == 0 and body.model == model_name


def test_messages_with_instructions_match_chat(server, client, model_name):
    """instructions are a system message put first; a developer message is a system message; text parts join by
    newlines; an earlier response's output items, sent back as input, are assistant messages."""
    first = client.responses.create(model=model_name, instructions="Answer in one word.",
                                    input=[{"role": "user", "content": QUESTION}], **GREEDY)
    turn2 = [{"role": "user", "content": QUESTION}, *[o.model_dump() for o in first.output],
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And of Spain?"},
                                                             {"type": "input_text", "text": "One word."}]}]
    r = client.responses.create(model=model_name, instructions="Answer in one word.", input=turn2, **GREEDY)
    chat = chat_twin(client, model_name, [{"role": "system", "content": "Answer in one word."},
                                          {"role": "user", "content": QUESTION},
                                          {"role": "assistant", "content": first.output_text},
                                          {"role": "user", "content": "And of Spain?\nOne word."}], 12)
    assert r.output_text == chat.choices[0].message.content and r.instructions == "Answer in one word."
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    developer = client.responses.create(model=model_name, input=[{"role": "developer", "content": "Be brief."},
                                                                 {"role": "user", "content": QUESTION}], **GREEDY)
    system = client.responses.create(model=model_name, instructions="Be brief.", input=QUESTION, **GREEDY)
    assert developer.output_text == system.output_text
    assert developer.usage.input_tokens == system.usage.input_tokens


def test_max_output_tokens_ends_it_incomplete(server, client, model_name):
    """The length limit makes the response and its message incomplete; usage counts the rendered chat (as
    /tokenize counts it) and the tokens generated; a repeated prompt is served from the prefix cache."""
    question = f"{uuid.uuid4().hex}: tell me a story."  # of the prompt, only the template's opening is cached
    lengths = server.metric("tokenmill:request_success_total", finished_reason="length")
    kwargs = dict(model=model_name, input=question, max_output_tokens=4, extra_body={"ignore_eos": True})
    r = client.responses.create(**kwargs)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    prompt = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": question}]}).json()
    assert r.usage.input_tokens == prompt["count"] and r.usage.output_tokens == 4
    assert r.usage.total_tokens == prompt["count"] + 4
    again = client.responses.create(**kwargs)
    cached = r.usage.input_tokens_details.cached_tokens, again.usage.input_tokens_details.cached_tokens
    assert cached[0] < cached[1] <= again.usage.input_tokens
    assert server.metric("tokenmill:request_success_total", finished_reason="length") == lengths + 2


def test_streaming_sends_openais_events_in_order(server, client, model_name):
    full = client.responses.create(model=model_name, input=QUESTION, **GREEDY)
    events = list(client.responses.create(model=model_name, input=QUESTION, **GREEDY, stream=True))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == [*EVENTS_IN_ORDER, *["response.output_text.delta"] * len(deltas), *EVENTS_AT_THE_END,
                     f"response.{full.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len(deltas) > 1 and all(deltas)
    final = events[-1].response
    assert "".join(deltas) == events[-4].text == final.output_text == full.output_text
    assert final.status == full.status
    assert (final.usage.input_tokens, final.usage.output_tokens) == (full.usage.input_tokens, full.usage.output_tokens)
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.id == events[0].response.id and final.output[0].id == events[2].item.id == events[3].item_id
    assert events[-2].item == final.output[0]


def test_event_lines_name_the_events_and_no_done(server, model_name):
    """Each `event:` line is its data's type, as OpenAI sends them; the stream ends with the response's last
    state, without chat's data: [DONE]."""
    events = sse(server, {"model": model_name, "input": QUESTION, "max_output_tokens": 3, "ignore_eos": True})
    assert all(name == data["type"] for name, data in events)
    assert events[-1][0] == "response.incomplete" and events[-1][1]["response"]["usage"]["output_tokens"] == 3


@pytest.mark.parametrize("field, kwargs", [
    ("previous_response_id", dict(previous_response_id="resp_123")),
    ("conversation", dict(conversation="conv_123")),
    ("prompt", dict(prompt={"id": "pmpt_123"})),
    ("background", dict(background=True)),
    ("tools", dict(tools=[{"type": "function", "name": "f", "parameters": {}}])),
    ("tool_choice", dict(tool_choice="required")),
    ("tool_choice", dict(tool_choice={"type": "function", "name": "f"})),
    ("text.format", dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}})),
    ("text.verbosity", dict(text={"verbosity": "low"})),
    ("reasoning.effort", dict(reasoning={"effort": "high"})),
    ("reasoning.summary", dict(reasoning={"summary": "auto"})),
    ("include", dict(include=["message.output_text.logprobs"])),
    ("truncation", dict(truncation="auto")),
    ("input.1", dict(input=[{"role": "user", "content": "hi"},
                            {"type": "function_call_output", "call_id": "c", "output": "42"}])),
    ("input.0.content.1", dict(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": "http://x/a.png"}]}])),
    ("n", dict(extra_body={"n": 2})),
    ("prompt_logprobs", dict(extra_body={"prompt_logprobs": 1})),
    ("guided_json", dict(extra_body={"guided_json": {"type": "object"}})),
])
def test_what_tokenmill_does_not_implement_is_refused_by_name(client, model_name, field, kwargs):
    kwargs = {"input": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_name, max_output_tokens=2, **kwargs)
    err = e.value.body
    assert err["param"] == field and err["code"] == "unsupported_parameter", err
    assert err["message"].startswith(field) and "not supported" in err["message"], err


def test_neutral_values_of_those_fields_are_accepted(client, model_name):
    r = client.responses.create(model=model_name, input="hi", max_output_tokens=2, tools=[], tool_choice="none",
                                text={"format": {"type": "text"}, "verbosity": "medium"},
                                reasoning={"effort": "none"}, include=[],
                                background=False, store=True, truncation="disabled", previous_response_id=None,
                                parallel_tool_calls=False, extra_body={"ignore_eos": True})
    assert r.usage.output_tokens == 2 and r.tool_choice == "none" and r.parallel_tool_calls is False


@pytest.mark.parametrize("body, param, contains", [
    ({}, "input", "Field required"),
    ({"input": []}, "input", "at least 1 item"),
    ({"input": 5}, "input", "must be a string or a list of messages"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", ""),
    ({"input": [{"role": "user", "content": 5}]}, "input.0.content", "must be a string or a list of text parts"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text", "required"),
    ({"input": "a lone \ud800 surrogate"}, "input", "lone surrogate"),
    ({"input": "hi", "metadata": {"k": 5}}, "metadata.k", ""),
    ({"input": "hi", "user": "\udc00"}, "user", "lone surrogate"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", ""),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens", "maximum context length is 1024"),
    ({"input": "hello " * 1500}, "input", "maximum context length is 1024"),
    ({"input": "hi", "temperature": 3}, "temperature", ""),
    ({"input": "hi", "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param, contains):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and contains in err["message"], err


def test_unknown_model_is_404(server, client, model_name):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-4o", input="hi")
    assert e.value.body == {"message": f"the model 'gpt-4o' does not exist; this server serves {model_name!r}",
                            "type": "not_found_error", "param": "model", "code": "model_not_found"}


def test_an_error_after_the_stream_began_is_an_error_event(server, client, model_name):
    """A request past its timeout_s: OpenAI's `error` event, carrying the other endpoints' error object, which
    OpenAI's client raises; the request is aborted."""
    body = {"model": model_name, "input": "Tell me a long story.", "max_output_tokens": 600, "ignore_eos": True,
            "timeout_s": 0.3}
    before = server.metric("tokenmill:request_abort_total", reason="timeout")
    events = sse(server, body)
    name, data = events[-1]
    assert name == "error" and data["type"] == "error" and data["code"] == "request_timeout"
    assert data["error"] == {"message": data["message"], "type": "timeout_error", "param": None,
                             "code": "request_timeout"}
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    with pytest.raises(openai.APIError, match="timeout"):
        list(client.responses.create(model=model_name, input=body["input"], max_output_tokens=600, stream=True,
                                     extra_body={"ignore_eos": True, "timeout_s": 0.3}))
    assert server.metric("tokenmill:request_abort_total", reason="timeout") == before + 2


def test_a_client_that_goes_away_aborts_the_stream(server, model_name):
    aborted = server.metric("tokenmill:request_abort_total", reason="client_disconnect")
    body = {"model": model_name, "input": "Tell me a long story.", "max_output_tokens": 600, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
    assert wait_until(lambda: server.metric("tokenmill:request_abort_total", reason="client_disconnect")
                      == aborted + 1)
    assert wait_until(lambda: server.metric("tokenmill:num_requests_running") == 0)


def test_random_garbage_never_500(server):
    rng = random.Random(0)
    fields = ["input", "instructions", "model", "tools", "tool_choice", "text", "reasoning", "include", "metadata",
              "stream", "temperature", "background", "previous_response_id", "truncation", "store", "user", "n",
              "conversation", "prompt", "top_p", "stream_options", "logit_bias"]
    values = [None, 0, -1, 1.5, 10 ** 30, "", "x", [], [1], {}, {"role": "user"}, True, "\u0000", [None],
              [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], {"type": "text"},
              [{"type": "message"}], [{"role": "user", "content": [{"type": "refusal"}]}], float("nan")]
    for _ in range(60):
        body = {k: rng.choice(values) for k in rng.sample(fields, rng.randint(1, 6))}
        r = post(server, json.dumps({**body, "max_output_tokens": 1}, allow_nan=True))
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health").status_code == 200


def test_openapi_schema_has_the_endpoint(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    post_ = schema["paths"]["/v1/responses"]["post"]
    assert "text/event-stream" in post_["responses"]["200"]["content"] and "400" in post_["responses"]
    fields = schema["components"]["schemas"]["ResponsesRequest"]["properties"]
    for field in ("input", "instructions", "max_output_tokens", "metadata", "store", "tools", "text", "reasoning",
                  "previous_response_id", "top_k", "ignore_eos", "priority"):
        assert field in fields, field


@pytest.fixture(scope="module")
def overridden():
    s = Server("--max-model-len", "1024", "--override-generation-config", '{"temperature": 0, "max_new_tokens": 5}')
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    s.stop()


def test_the_models_sampling_defaults_apply_as_to_chat(overridden):
    """Unset temperature takes the model's (0, echoed), the operator's max_new_tokens caps max_output_tokens."""
    model = overridden.models.list().data[0].id
    r = overridden.responses.create(model=model, input=QUESTION, max_output_tokens=9, extra_body={"ignore_eos": True})
    assert r.usage.output_tokens == 5 and r.status == "incomplete" and r.temperature == 0
    chat = overridden.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                              extra_body={"ignore_eos": True})
    assert r.output_text == chat.choices[0].message.content
