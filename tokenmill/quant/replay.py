"""Replay the user's own prompts through the base and the quantized model (greedy, one engine at a time so
both fit) and report what users notice: the same first token, the same whole answer, and answers that stay
in the base model's format (valid JSON where the base answer was valid JSON).

prompts.jsonl: one JSON object a line, {"prompt": "..."} (sent as a user message through the chat template
when the model has one, unless "raw": true) or {"messages": [...]}; an optional "max_tokens" overrides the
default.
"""
from __future__ import annotations

import gc
import json
from typing import Any

import torch

from tokenmill.sampling_params import SamplingParams


def load_prompts(path: str) -> list[dict[str, Any]]:
    """The prompts of a JSONL file, or a ValueError naming --replay, the file and the line that is wrong."""
    prompts = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--replay {path} cannot be read ({e.strerror}); give a JSONL file of prompts") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                reason = "nested too deep" if isinstance(e, RecursionError) else str(e)
                raise ValueError(f"{path}:{n}: not valid JSON ({reason})") from None
            problem = _problem(item)
            if problem:
                raise ValueError(f"{path}:{n}: {problem}")
            prompts.append(item)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _problem(item: Any) -> str | None:
    """What is wrong with one line's object, checked before any model runs."""
    if not isinstance(item, dict) or not ({"prompt", "messages"} & item.keys()):
        return "expected an object with a 'prompt' or 'messages' key"
    if "messages" in item:
        messages = item["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            return "'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} strings"
    elif not isinstance(item["prompt"], str) or not item["prompt"]:
        return "'prompt' must be a non-empty string"
    max_tokens = item.get("max_tokens", 1)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return f"'max_tokens' must be an integer >= 1, got {max_tokens!r}"
    return None


def parses_as_json(text: str) -> bool:
    """The answer is a JSON document, bare or in one ``` fence."""
    body = text.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0]
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def _generate(engine_args: dict[str, Any], prompts: list[dict[str, Any]], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of every prompt from one engine, freed before returning."""
    from tokenmill.entrypoints.llm import LLM
    llm = LLM(**engine_args)
    tok = llm.get_tokenizer()
    inputs, params = [], []
    for p in prompts:
        if "messages" in p or (tok.chat_template and not p.get("raw")):
            messages = p["messages"] if "messages" in p else [{"role": "user", "content": p["prompt"]}]
            inputs.append(tok.encode(tok.apply_chat_template(messages), add_special_tokens=False))
        else:
            inputs.append(p["prompt"])
        params.append(SamplingParams(temperature=0.0, max_tokens=p.get("max_tokens", max_tokens)))
    outputs = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [list(ids) for ids in outputs]


def replay(prompts: list[dict[str, Any]], base_args: dict[str, Any], quant_args: dict[str, Any],
           max_tokens: int = 128) -> dict[str, Any]:
    """Agreement of the quantized engine (quant_args) with the base engine (base_args) on the prompts."""
    from tokenmill.model.loader import resolve_model
    from tokenmill.tokenizer import load_tokenizer
    base = _generate(base_args, prompts, max_tokens)
    quant = _generate(quant_args, prompts, max_tokens)
    tok = load_tokenizer(resolve_model(base_args.get("model")))
    rows = []
    for b, q in zip(base, quant):
        b_text, q_text = tok.decode(b), tok.decode(q)
        rows.append({"first_token_match": b[:1] == q[:1], "exact_match": b == q,
                     "base_json": parses_as_json(b_text), "quant_json": parses_as_json(q_text),
                     "base": b_text, "quant": q_text})
    json_base = [r for r in rows if r["base_json"]]
    return {"prompts": len(rows),
            "first_token_agreement": sum(r["first_token_match"] for r in rows) / len(rows),
            "exact_match_rate": sum(r["exact_match"] for r in rows) / len(rows),
            "json_prompts": len(json_base),
            "json_stability": (sum(r["quant_json"] for r in json_base) / len(json_base)) if json_base else None,
            "rows": rows}
