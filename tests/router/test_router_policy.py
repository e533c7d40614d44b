"""The routing policy and the backend's health state, without processes."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tokenmill.router.backend import DOWN_AFTER_TIMEOUTS, KV_WEIGHT, Backend
from tokenmill.router.policy import Router, choose, route_info
from tokenmill.router.proxy import _complete_events


def chat(*messages: tuple[str, str]) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}).encode()


def completion(prompt) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt}).encode()


def backends(n: int, pool: str = "short") -> list[Backend]:
    out = [Backend(f"http://10.0.0.{i}:8000", pool) for i in range(n)]
    for b in out:
        b.healthy = True
    return out


def test_every_turn_of_a_conversation_has_the_same_key():
    turn1 = route_info("/v1/chat/completions", chat(("system", "be brief"), ("user", "hello")))
    turn3 = route_info("/v1/chat/completions", chat(("system", "be brief"), ("user", "hello"), ("assistant", "hi"),
                                                    ("user", "how are you?"), ("assistant", "fine"),
                                                    ("user", "bye")))
    other = route_info("/v1/chat/completions", chat(("system", "be brief"), ("user", "hello!")))
    assert turn1.key is not None and turn1.key == turn3.key != other.key


def test_prompt_length_is_characters_over_four():
    info = route_info("/v1/chat/completions", chat(("system", "x" * 40), ("user", "y" * 41)))
    assert info.prompt_tokens == 21
    parts = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "z" * 8}]}]}).encode()
    assert route_info("/v1/chat/completions", parts).prompt_tokens == 2
    assert route_info("/v1/completions", completion("a" * 400)).prompt_tokens == 100
    assert route_info("/v1/completions", completion(list(range(300)))).prompt_tokens == 300
    assert route_info("/v1/completions", completion(["a" * 8, "b" * 800])).prompt_tokens == 200


def test_completion_key_is_the_prompt_beginning():
    a = route_info("/v1/completions", completion("p" * 200 + "first turn"))
    b = route_info("/v1/completions", completion("p" * 200 + "first turn, second turn"))
    assert a.key == b.key
    assert route_info("/v1/completions", completion([1, 2, 3])).key != route_info("/v1/completions",
                                                                                    completion([1, 2, 4])).key


def test_a_responses_request_routes_as_the_chat_it_renders():
    """Its instructions and input are that chat's system and user messages: the chat's key on every turn (an
    earlier response's output sent back included), and the chat's length."""
    as_chat = route_info("/v1/chat/completions", chat(("system", "be brief"), ("user", "hello")))
    first = route_info("/v1/responses",
                       json.dumps({"model": "m", "instructions": "be brief", "input": "hello"}).encode())
    second = route_info("/v1/responses", json.dumps({"instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
        {"role": "user", "content": "bye"}]}).encode())
    assert as_chat.key is not None and first.key == second.key == as_chat.key
    assert first.prompt_tokens == as_chat.prompt_tokens and first.model == "m"
    assert route_info("/v1/responses", json.dumps({"input": "hello!"}).encode()).key != first.key


def test_a_lone_surrogate_in_a_prompt_still_routes():
    """The backend refuses it with a 400; the router must get it there, not fail with a 500 of its own."""
    for body in (b'{"prompt": "\\ud800 hi"}', b'{"prompt": ["ok", "\\udfff"]}'):
        info = route_info("/v1/completions", body)
        assert info.key is not None and info.prompt_tokens == 1


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", b"not json"), ("/v1/chat/completions", b"[1]"),
                                       ("/v1/chat/completions", b'{"messages": "hi"}'),
                                       ("/v1/chat/completions", b'{"messages": []}'),
                                       ("/v1/completions", b'{"prompt": [1, "a"]}'),
                                       ("/v1/completions", b'{"prompt": []}'),
                                       ("/v1/responses", b'{"input": 5}'),
                                       ("/tokenize", b'{"prompt": "hi"}'),
                                       ("/v1/chat/completions", b"[" * 100_000)])  # too deep for json.loads
def test_bodies_without_a_key_route_by_load_alone(path, body):
    info = route_info(path, body)
    assert info.key is None and info.prompt_tokens == 0


def test_affinity_holds_until_the_slack_is_exceeded():
    bs = backends(3)
    key = b"conversation"
    first = choose(bs, key, slack=4.0)
    assert first.policy == "affinity"
    first.backend.in_flight = 4  # 4 over the others: still within the slack
    assert choose(bs, key, slack=4.0) == first
    first.backend.in_flight = 5
    spill = choose(bs, key, slack=4.0)
    assert spill.policy == "least_load" and spill.backend is not first.backend
    assert choose(bs, key, slack=4.0) == spill  # the spill-over is sticky: ties go to the better ranked


def test_load_counts_the_backends_own_metrics():
    b = backends(1)[0]
    b._read_load('# TYPE tokenmill:num_requests_running gauge\n'
                 'tokenmill:num_requests_running{model_name="m"} 3.0\n'
                 '# TYPE tokenmill:num_requests_waiting gauge\n'
                 'tokenmill:num_requests_waiting{model_name="m"} 2.0\n'
                 '# TYPE tokenmill:kv_cache_usage_perc gauge\n'
                 'tokenmill:kv_cache_usage_perc{model_name="m"} 0.5\n')
    assert (b.running, b.waiting, b.kv_usage) == (3.0, 2.0, 0.5)
    assert b.load() == 5 + 2 + KV_WEIGHT * 0.5
    b.in_flight = 9  # the router's own count is ahead of the last poll
    assert b.load() == 9 + 2 + KV_WEIGHT * 0.5


def test_rendezvous_moves_only_the_keys_of_a_removed_backend():
    bs = backends(4)
    keys = [f"conversation {i}".encode() for i in range(200)]
    before = {k: choose(bs, k, 0.0).backend for k in keys}
    assert len(set(before.values())) == 4
    gone = bs[1]
    after = {k: choose([b for b in bs if b is not gone], k, 0.0).backend for k in keys}
    assert all(after[k] is before[k] for k in keys if before[k] is not gone)


def test_no_key_goes_to_the_least_loaded():
    bs = backends(3)
    bs[0].in_flight, bs[1].in_flight, bs[2].in_flight = 2, 1, 3
    assert choose(bs, None, 4.0).backend is bs[1]


def test_long_prompts_go_to_the_long_pool_and_pools_fall_back():
    short, long = backends(2, "short"), backends(1, "long")
    router = Router(short, long, long_threshold=100, slack=4.0)
    small = route_info("/v1/completions", completion("a" * 400))   # 100 tokens: not over the threshold
    big = route_info("/v1/completions", completion("a" * 404))     # 101
    assert router.pick(small, set()).backend in short
    assert router.pick(big, set()).backend is long[0]
    long[0].healthy = False
    assert router.pick(big, set()).backend in short
    assert router.pick(small, set(short)) is None
    long[0].healthy = True
    assert router.pick(small, set(short)).backend is long[0]
    assert Router(short, [], 100, 4.0).pick(big, set()).backend in short


def test_complete_events_cut_at_the_last_blank_line():
    assert _complete_events(b'data: {"a": 1}\n\ndata: {"b"') == len(b'data: {"a": 1}\n\n')
    assert _complete_events(b"data: x\r\n\r\n") == 11
    assert _complete_events(b"data: partial") == 0


def poll_once(b: Backend, handler) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await b.poll(client, timeout=1.0)

    asyncio.run(run())


METRICS = "# TYPE tokenmill:num_requests_waiting gauge\ntokenmill:num_requests_waiting{model_name=\"m\"} 7.0\n"


def test_health_states():
    answer = {"status": 200}

    def handler(request: httpx.Request) -> httpx.Response:
        if answer["status"] == "refused":
            raise httpx.ConnectError("refused", request=request)
        if answer["status"] == "timeout":
            raise httpx.ReadTimeout("slow", request=request)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        return httpx.Response(answer["status"], json={})

    b = Backend("http://backend", "short")
    poll_once(b, handler)
    assert b.healthy and not b.dead.is_set() and b.waiting == 7.0
    answer["status"] = 503  # draining: no new requests, the ones in flight go on
    poll_once(b, handler)
    assert not b.healthy and not b.dead.is_set()
    answer["status"] = "timeout"
    for _ in range(DOWN_AFTER_TIMEOUTS - 1):
        poll_once(b, handler)
        assert not b.dead.is_set()
    poll_once(b, handler)
    assert b.dead.is_set()
    answer["status"] = 200
    poll_once(b, handler)
    assert b.healthy and not b.dead.is_set()
    answer["status"] = "refused"
    poll_once(b, handler)
    assert not b.healthy and b.dead.is_set()
