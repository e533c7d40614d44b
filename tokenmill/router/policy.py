"""Which backend gets a request: the pool by estimated prompt length, then the conversation's backend by
rendezvous hashing (so its prefix cache hits), unless that one is overloaded, then the least loaded one."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tokenmill.router.backend import Backend

CHARS_PER_TOKEN = 4        # prompt length estimate without a tokenizer round trip
COMPLETION_KEY_CHARS = 128  # a completion prompt's affinity key: its first characters ...
COMPLETION_KEY_TOKENS = 32  # ... or its first token ids


@dataclass(frozen=True)
class RouteInfo:
    key: bytes | None   # requests with the same key share a prefix; None: no affinity
    prompt_tokens: int  # estimated
    model: str | None = None  # the body's "model": only backends serving it take the request, where any does


@dataclass(frozen=True)
class Choice:
    backend: Backend
    policy: str  # "affinity": the key's own backend | "least_load"


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _chat_info(messages: Any) -> RouteInfo:
    """The key is the conversation's opening, everything up to and including the first user message: every turn
    of one conversation repeats it, so all turns land where the earlier ones left their KV cache."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return RouteInfo(None, 0)
    opening = []
    for m in messages:
        opening.append([m.get("role"), _text(m.get("content"))])
        if m.get("role") == "user":
            break
    chars = sum(len(_text(m.get("content"))) for m in messages)
    return RouteInfo(json.dumps(opening).encode(), -(-chars // CHARS_PER_TOKEN))


def _responses_info(data: dict[str, Any]) -> RouteInfo:
    """A Responses request is the chat of its instructions (a system message) and input (a string: one user
    message), keyed and measured as that chat is, so that it shares a backend with the same chat's turns."""
    messages = data.get("input")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    instructions = data.get("instructions")
    if isinstance(instructions, str) and isinstance(messages, list):
        messages = [{"role": "system", "content": instructions}, *messages]
    return _chat_info(messages)


def _prompt_info(prompt: Any) -> tuple[bytes, int] | None:
    """surrogatepass: JSON may carry a lone surrogate ("\\ud800"), which the backend refuses with a 400 of its own."""
    if isinstance(prompt, str) and prompt:
        return prompt[:COMPLETION_KEY_CHARS].encode("utf-8", "surrogatepass"), -(-len(prompt) // CHARS_PER_TOKEN)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return json.dumps(prompt[:COMPLETION_KEY_TOKENS]).encode(), len(prompt)
    return None


def _completion_info(prompt: Any) -> RouteInfo:
    """The key is the prompt's beginning (of the first prompt of a batch); the length is the longest prompt's."""
    single = _prompt_info(prompt)
    if single is not None:
        return RouteInfo(*single)
    infos = [_prompt_info(p) for p in prompt] if isinstance(prompt, list) and prompt else [None]
    if any(i is None for i in infos):
        return RouteInfo(None, 0)
    return RouteInfo(infos[0][0], max(n for _, n in infos))


def route_info(path: str, body: bytes) -> RouteInfo:
    """What routing needs from a request body; a body the backend will refuse routes anywhere, for the backend's
    own error."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the interpreter's stack
        return RouteInfo(None, 0)
    if not isinstance(data, dict):
        return RouteInfo(None, 0)
    model = data.get("model") if isinstance(data.get("model"), str) else None
    if path == "/v1/chat/completions":
        info = _chat_info(data.get("messages"))
    elif path == "/v1/completions":
        info = _completion_info(data.get("prompt"))
    elif path == "/v1/responses":
        info = _responses_info(data)
    else:
        info = RouteInfo(None, 0)
    return dataclasses.replace(info, model=model)


def _weight(key: bytes, backend: Backend) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\0" + backend.url.encode(), digest_size=8).digest(), "big")


def choose(backends: list[Backend], key: bytes | None, slack: float) -> Choice:
    """Rendezvous hashing ranks the backends for the key: the first keeps it unless its load is more than `slack`
    over the least load, and a backend coming or going moves only the keys it ranks first. Ties of least load
    go to the better ranked one, so an overloaded key's spill-over is sticky too."""
    ranked = sorted(backends, key=lambda b: _weight(key, b), reverse=True) if key is not None else backends
    loads = [b.load() for b in ranked]
    least = min(loads)
    if key is not None and loads[0] <= least + slack:
        return Choice(ranked[0], "affinity")
    return Choice(ranked[loads.index(least)], "least_load")


class Router:
    """The backends in two pools: prompts estimated longer than `long_threshold` tokens go to the long pool (when
    there is one), the rest to the short pool. A pool with no healthy backend falls back to the other."""

    def __init__(self, short: list[Backend], long: list[Backend], long_threshold: int, slack: float) -> None:
        self.short = short
        self.long = long
        self.long_threshold = long_threshold
        self.slack = slack

    @property
    def backends(self) -> list[Backend]:
        return self.short + self.long

    def pick(self, info: RouteInfo, exclude: set[Backend]) -> Choice | None:
        """None when no backend of either pool is healthy and not excluded. Backends that serve the request's model
        come first, in either pool; where none does, any takes it and answers with its own 404."""
        pool = self.long if self.long and info.prompt_tokens > self.long_threshold else self.short
        pools = (pool, self.long if pool is self.short else self.short)
        for by_model in (True, False):
            for candidates in pools:
                healthy = [b for b in candidates if b.healthy and b not in exclude
                           and (not by_model or b.serves(info.model))]
                if healthy:
                    return choose(healthy, info.key, self.slack)
        return None
