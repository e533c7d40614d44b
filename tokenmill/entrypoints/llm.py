"""LLM: the offline Python API (vLLM's names): generate and chat over a batch of prompts."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from tqdm import tqdm

from tokenmill.config import EngineArgs
from tokenmill.core.scheduler import QueueFullError
from tokenmill.engine.devices import offline_max_num_batched_tokens, pick_device
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict[str, Any]  # dict: vLLM's {"prompt": text} or {"prompt_token_ids": ids}


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """engine_args: EngineArgs' fields. Without max_num_batched_tokens the step budget is vLLM's offline
        default for the device (devices.offline_max_num_batched_tokens: 16384 on an H100 / H200)."""
        if "max_num_batched_tokens" not in engine_args:
            engine_args["max_num_batched_tokens"] = offline_max_num_batched_tokens(
                pick_device(engine_args.get("device", "auto")), EngineArgs.max_num_batched_tokens)
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_args))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (LLMEngine.reset_prefix_cache)."""
        self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's own defaults (EngineArgs.generation_config): what generate and chat use
        when given none, and a base to change (vLLM's)."""
        return SamplingParams(**self.llm_engine.default_sampling)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a string, a list of token ids, a {\"prompt\": ...} or "
                             f'{{"prompt_token_ids": ...}} dict, or a list of these; got {type(prompts).__name__}')
        prompts = [_prompt(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:  # checked before any prompt is queued
            params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params]
            for sp in params:
                if not isinstance(sp, SamplingParams):
                    raise ValueError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), "
                                     f"got {sp!r}")
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        engine = self.llm_engine
        ids: list[str] = []
        ours: set[str] = set()
        final: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else len(prompts) >= 32
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not show, dynamic_ncols=True)
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                sp = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                while True:
                    try:
                        ids.append(engine.add_request(None, p, sp, priority=priority[i] if priority else 0))
                        ours.add(ids[-1])
                        break
                    except QueueFullError:  # more prompts than the queue holds: run some first, as vLLM takes any
                        if not engine.has_unfinished_requests():  # number offline
                            raise
                        self._step(ours, final, bar)
            while len(final) < len(ids):
                self._step(ours, final, bar)
        except BaseException:  # a bad prompt or an interrupt: none of this call's requests stays queued
            engine.abort_request([i for i in ids if i not in final])
            raise
        finally:
            bar.close()
        return [final[i] for i in ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template (or chat_template, a jinja2 string) to one conversation (or a list of
        them) and generate; continue_final_message (with add_generation_prompt=False): the model goes on with the
        last message, e.g. a prefilled assistant answer; chat_template_kwargs: more variables for the template."""
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer; this engine has none (dummy weights)")
        if not isinstance(messages, list):
            raise ValueError("messages must be a list of {\"role\": ..., \"content\": ...} dicts (one conversation) or a "
                             f"list of such lists; got {type(messages).__name__} {messages!r:.80}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [tok.encode(tok.apply_chat_template(_messages(c), add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      chat_template=chat_template,
                                                      chat_template_kwargs=chat_template_kwargs),
                              add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _step(self, ours: set[str], final: dict[str, RequestOutput], bar: tqdm) -> None:
        """One engine step; this call's finished requests go into final."""
        for out in self.llm_engine.step():
            if out.finished and out.request_id in ours and out.request_id not in final:
                final[out.request_id] = out
                bar.update(1)


def _prompt(prompt: Any) -> str | list[int]:
    """A prompt for the engine: text or token ids as given, or the one taken from vLLM's TextPrompt /
    TokensPrompt dict (list() of a dict would otherwise make its keys the prompts)."""
    if not isinstance(prompt, dict):
        return prompt
    if prompt.keys() in ({"prompt"}, {"prompt_token_ids"}):
        return next(iter(prompt.values()))  # its type is checked with any other prompt's
    raise ValueError('a dict prompt must be {"prompt": text} or {"prompt_token_ids": [token ids]}, '
                     f"got {prompt!r}")


def _messages(conversation: Any) -> list[dict[str, Any]]:
    """A conversation for the chat template: dicts with a string role and content (None: empty), OpenAI's text
    parts ([{"type": "text", "text": ...}]) joined as the server joins them; anything else is a ValueError."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"a conversation must be a non-empty list of messages, got {conversation!r}")
    out = []
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a string 'role', got {m!r}")
        content = m.get("content")
        if content is None:  # as the server: an assistant turn may carry none
            content = ""
        elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"message {i}'s content must be a string or a list of text parts "
                             f'({{"type": "text", "text": ...}}), got {m.get("content")!r}')
        out.append({**m, "content": content})
    return out
