"""Chat completions, completions and responses: a validated request becomes token ids, checked against the
context, then engine requests; their outputs become one JSON response or a stream of server-sent events (ending in
[DONE], or for responses in the response's last state, as OpenAI's).

A request whose client goes away, streaming or not, is aborted at once, so its KV blocks are freed before the next
engine step; the disconnect is watched from the moment a handler starts, before the engine has taken the request."""
from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from tokenmill.engine.async_engine import AsyncEngine, RequestFailedError, RequestStream, RequestTimeoutError
from tokenmill.engine.llm_engine import QueueFullError
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams, truncated_prompt
from tokenmill.serve.errors import APIError, sse_error
from tokenmill.serve.metrics import ServerMetrics
from tokenmill.serve.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                      CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                      DeltaMessage, PromptLogprob, PromptLogprobs, PromptTokensDetails, SamplingRequest,
                                      TokenLogprob, TopLogprob, Usage)
from tokenmill.serve.responses import ResponseEvents, finished, message_id, started
from tokenmill.serve.responses_protocol import ResponsesRequest
from tokenmill.tokenizer import check_chat_template_kwargs, compiled_chat_template

_Req = TypeVar("_Req", bound=SamplingRequest)

RETRY_AFTER_S = 1
FITS_SLACK = 4  # how much a tokenizer's normalizer may shrink a text, at most (encode's fits)


class EventStreamResponse(StreamingResponse):
    """Server-sent events. `on_close` runs however the response ends (the client may vanish before the first
    event, or while the generator waits to be resumed): it aborts whatever did not finish."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            self._on_close()


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A completion request's prompts, one entry each: a string and a list of token ids are one prompt."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _invalid_value(e: ValueError, req: SamplingRequest) -> APIError:
    """The 400 of a SamplingParams or engine ValueError: its message begins with the field it is about ('top_p
    must be ...', 'priority=9 ...'), which is the error's param where the request has that field."""
    field = str(e).split(" ")[0].split("=")[0]
    return APIError(400, str(e), field if field in type(req).model_fields else None, "invalid_value")


def _cancel_on_disconnect(handler: Callable[[OpenAIServing, _Req], Awaitable[Response]]
                          ) -> Callable[[OpenAIServing, _Req, Request], Awaitable[Response]]:
    """vLLM's with_cancellation: the handler runs only while its client is connected, and its cancellation aborts
    the requests it added. Watching only once the engine had taken a request missed a client gone during the
    request's first step: a prompt prefilled and answered in that step counted as finished, not aborted."""

    @functools.wraps(handler)
    async def run(self: OpenAIServing, req: _Req, raw: Request) -> Response:
        work = asyncio.ensure_future(handler(self, req))
        watcher = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            work.cancel()
        if work not in done:
            await asyncio.gather(work, return_exceptions=True)  # its aborts are made before the 499
            raise APIError(499, "the client disconnected", code="client_disconnected")
        return work.result()

    return run


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics,
                 trust_request_chat_template: bool = False,
                 default_chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.trust_request_chat_template = trust_request_chat_template
        self.default_chat_template_kwargs = default_chat_template_kwargs or {}  # a request's own override them
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.default_sampling = engine.engine.default_sampling  # the model's (--generation-config)
        self.max_tokens_cap = engine.engine.max_tokens_cap  # the operator's max_new_tokens, on every request
        self.draining = False

    # ---- checks -----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """None or "" is the served model, as vLLM takes them: clients that must send a model send "" for "any"."""
        if model and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def _admit(self, req: SamplingRequest) -> None:
        if self.draining:
            self.metrics.on_reject("draining")
            raise APIError(503, "the server is shutting down and takes no new requests", code="draining")
        self.check_model(req.model)
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer (dummy weights); text generation is unavailable")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
        unsupported = req.unsupported()
        if unsupported:  # refused, not ignored: a client setting one expects it honoured
            name, message = unsupported[0]
            raise APIError(400, message, name, "unsupported_parameter")

    def _max_tokens(self, prompt_len: int, requested: int | None, what: str, field: str = "max_tokens") -> int:
        """field: the request's name for `requested`, which an error names. Unset, it is what the context leaves,
        or the model's max_new_tokens if fewer; set, the operator's max_new_tokens caps it (vLLM's rules)."""
        if requested is not None and self.max_tokens_cap is not None:
            requested = min(requested, self.max_tokens_cap)
        limit = self.max_model_len
        if prompt_len == 0:
            raise APIError(400, f"the {what} is empty: at least one token is required", what, "empty_prompt")
        if prompt_len >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but the {what} has "
                                f"{prompt_len} tokens (at least one must be left for the output); shorten the "
                                f"{what}", what, "context_length_exceeded")
        if requested is not None and prompt_len + requested > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but "
                                f"{prompt_len + requested} were requested ({prompt_len} in the {what}, {requested} "
                                f"for the output); lower {field} or shorten the prompt", field,
                           "context_length_exceeded")
        pool = self.engine.engine.scheduler.max_request_len
        if prompt_len + (requested or 1) > pool:  # the KV cache holds fewer tokens than the context allows
            param = what if prompt_len >= pool else field
            raise APIError(400, f"this server's KV cache holds at most {pool} tokens of one request (less than its "
                                f"maximum context length {limit}), but {prompt_len + (requested or 1)} are needed "
                                f"({prompt_len} in the {what}, {requested or 1} for the output); "
                                f"{'shorten the prompt' if param == what else f'lower {field} or shorten the prompt'}",
                           param, "context_length_exceeded")
        if requested is not None:
            return requested
        return min(pool - prompt_len, self.default_sampling.get("max_tokens", pool))

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """JSON's keys are strings: OpenAI's token ids in decimal digits. int() alone would also take ' 1', '+1'
        and '1_0', and fail on more than 4300 digits."""
        if bias is None:
            return None
        bad = [k for k in bias if not (k.isascii() and k.isdigit() and len(k) <= 18)]
        if bad:
            vocab = self.engine.engine.model_config.vocab_size
            raise APIError(400, f"logit_bias keys must be token ids, decimal integers in [0, {vocab}), got "
                                f"{bad[0][:40]!r}", "logit_bias", "invalid_value")
        return {int(k): v for k, v in bias.items()}

    def _default(self, req: SamplingRequest, name: str) -> Any:
        """A sampling field the request leaves unset (or null) takes the model's default (--generation-config),
        else the field's own."""
        own = getattr(req, name)
        return own if name in req.model_fields_set else self.default_sampling.get(name, own)

    def _sampling_params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        logit_bias = self._logit_bias(req.logit_bias)
        try:
            params = SamplingParams(n=req.n, temperature=self._default(req, "temperature"),
                                    top_p=self._default(req, "top_p"), top_k=self._default(req, "top_k"),
                                    min_p=self._default(req, "min_p"),
                                    repetition_penalty=self._default(req, "repetition_penalty"),
                                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                    seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
                                    stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                                    include_stop_str_in_output=req.include_stop_str_in_output,
                                    skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs, logit_bias=logit_bias,
                                    allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words)
            params.verify_vocab(self.engine.engine.model_config.vocab_size)
        except ValueError as e:
            raise _invalid_value(e, req) from e
        return params

    async def _add(self, prompts: list[tuple[str, list[int], SamplingParams]],
                   req: SamplingRequest) -> list[RequestStream]:
        """Hand the prompts to the engine, all or none."""
        queue = self.engine.engine.scheduler.config.max_queue_len
        if len(prompts) * req.n > queue:  # a retry could never make room for them: not a 429
            raise APIError(400, f"{len(prompts)} prompts with n={req.n} are {len(prompts) * req.n} requests, more "
                                f"than the waiting queue holds ({queue}, --max-queue-len); send at most {queue}",
                           "prompt" if len(prompts) > 1 else "n", "invalid_value")
        try:
            return await self.engine.add_requests(prompts, req.priority, req.timeout_s)
        except BaseException as e:
            if isinstance(e, QueueFullError):
                self.metrics.on_reject("queue_full")
                raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from e
            if isinstance(e, ValueError):
                raise _invalid_value(e, req) from e
            if isinstance(e, RequestFailedError):
                raise APIError(503, str(e), code="shutdown" if self.draining else "engine_unavailable") from e
            raise

    def _abort(self, streams: list[RequestStream], reason: str) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request_id, reason)

    def _request_error(self, e: Exception) -> APIError:
        if isinstance(e, RequestTimeoutError):
            return APIError(504, f"{e} and was aborted", code="request_timeout")
        if self.draining:
            return APIError(503, str(e), code="shutdown")
        if self.engine.failure is not None:
            return APIError(503, str(e), code="engine_unavailable")
        return APIError(500, str(e), code="engine_error")

    async def _collect(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """The final output of each request; those unfinished are aborted if it ends first (an error, or the
        handler cancelled by its client's disconnect)."""
        finals: list[RequestOutput] = [None] * len(streams)  # type: ignore[list-item]
        reason = "client_disconnect"
        try:
            async for i, out in _merge(streams):
                finals[i] = out
        except (RequestTimeoutError, RequestFailedError) as e:
            reason = "error"
            raise self._request_error(e) from e
        finally:
            self._abort(streams, reason)
        return finals

    # ---- token text -------------------------------------------------------------------------
    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, lps: list[Logprob]) -> ChatLogprobs:
        def top(tid: int, lp: float) -> TopLogprob:
            text = self._token_text(tid)
            return TopLogprob(token=text, logprob=lp, bytes=list(self.tokenizer.token_bytes(tid)))

        content = []
        for lp in lps:
            chosen = top(lp.token_id, lp.logprob)
            content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=[top(t, v) for t, v in lp.top.items()]))
        return ChatLogprobs(content=content)

    def _completion_logprobs(self, lps: list[Logprob | None], offset: int, k: int, first_id: int = -1
                             ) -> CompletionLogprobs:
        """OpenAI's (and vLLM's) top_logprobs always hold the sampled token, so up to k + 1 entries. A None entry
        is an echoed prompt's first token (first_id), which nothing precedes: no logprob, no alternatives."""
        tokens = [self._token_text(first_id if lp is None else lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[None if lp is None else lp.logprob for lp in lps],
            top_logprobs=[None if lp is None else {**{self._token_text(t): v for t, v in list(lp.top.items())[:k]},
                                                   token: lp.logprob} for token, lp in zip(tokens, lps)],
            text_offset=offsets)

    def _prompt_logprobs(self, out: RequestOutput, k: int | None) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs of a request that asked for k (None: it did not): per prompt position, the
        prompt token's entry, then its k likeliest alternatives' (ranks 1 to k)."""
        if k is None or out.prompt_logprobs is None:
            return None
        result: PromptLogprobs = []
        for lp in out.prompt_logprobs:
            if lp is None:
                result.append(None)
                continue
            entries = {str(lp.token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                       decoded_token=self._token_text(lp.token_id))}
            for rank, (t, v) in enumerate(list(lp.top.items())[:k], 1):
                entries.setdefault(str(t), PromptLogprob(logprob=v, rank=rank, decoded_token=self._token_text(t)))
            result.append(entries)
        return result

    async def encode(self, text: str, add_special_tokens: bool = True, fits: str | None = None) -> list[int]:
        """Token ids of a text, encoded in a worker thread: `tokenizers` releases the GIL, so a long prompt (up to
        the body limit, seconds of encoding) does not stall the event loop, every other stream and /health with it.
        fits: the request's name for a text that must fit the context; one that cannot, whatever its tokens, is
        refused before encoding (a 15 MB prompt took 37 s to encode before its 400)."""
        if fits is not None:
            self._check_fits(text, fits)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    def _check_fits(self, text: str, what: str) -> None:
        """No token stands for more than max_token_bytes bytes of text, so a text has at least its UTF-8 size over
        that many tokens. Normalizers may shrink a text before it is split (NFC composes up to 3 jamo into one
        Hangul syllable): the bound is taken with a slack of 4."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size < FITS_SLACK * self.max_model_len:  # fits whatever the vocabulary: no need to know its longest
            return
        at_least = size // (FITS_SLACK * self.max_token_bytes)
        if at_least >= self.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens, but the {what} "
                                f"has at least {at_least} ({size} bytes of text, no token longer than "
                                f"{self.max_token_bytes} bytes); shorten the {what}", what, "context_length_exceeded")

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token of the vocabulary stands for (special tokens included)."""
        return max(1, max(len(self.tokenizer.token_bytes(i)) for i in range(self.tokenizer.vocab_size)))

    # ---- chat completions -------------------------------------------------------------------
    async def chat_prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                              continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
                              chat_template: str | None = None, fits: bool = False,
                              add_special_tokens: bool = False, what: str = "messages") -> list[int]:
        """A developer message is a system message, as OpenAI treats it (its newer name for system): most chat
        templates know system only, and SmolLM2's rendered developer as a turn of its own after its default system
        prompt. chat_template: the request's, taken only from a server that trusts them (a template is code the
        server runs; vLLM's --trust-request-chat-template). fits: a rendered chat that cannot fit the context is
        refused before encoding (encode's). add_special_tokens: vLLM's, off for chat (the template holds a BOS).
        what: the request's name for the messages, which an error names."""
        conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                         **({"name": m.name} if m.name else {})} for m in messages]
        if continue_final_message and add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true; send "
                                "add_generation_prompt: false to continue the last message", "continue_final_message")
        try:
            template_vars = {**self.default_chat_template_kwargs, **check_chat_template_kwargs(chat_template_kwargs)}
        except ValueError as e:
            raise APIError(400, str(e), "chat_template_kwargs") from e
        if chat_template is not None:
            if not self.trust_request_chat_template:
                raise APIError(400, "this server does not take a request's chat_template (start it with "
                                    "--trust-request-chat-template to allow them); omit chat_template",
                               "chat_template")
            try:
                compiled_chat_template(chat_template)
            except ValueError as e:
                raise APIError(400, str(e), "chat_template") from e
        try:  # in a worker thread: a template is Python, and a long chat took the event loop for a second
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, conversation,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message,
                                           chat_template=chat_template, chat_template_kwargs=template_vars)
        except Exception as e:
            raise APIError(400, str(e), what, "chat_template_error") from e  # the tokenizer names the template
        return await self.encode(text, add_special_tokens=add_special_tokens, fits=what if fits else None)

    @_cancel_on_disconnect
    async def chat(self, req: ChatCompletionRequest) -> Response:
        self._admit(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs is only allowed with logprobs: true", "top_logprobs")
        ids = await self.chat_prompt_ids(req.messages, req.add_generation_prompt, req.continue_final_message,
                                         req.chat_template_kwargs, req.chat_template,
                                         fits=req.truncate_prompt_tokens is None,
                                         add_special_tokens=req.add_special_tokens)
        if req.truncate_prompt_tokens is not None:  # before the length checks, as vLLM
            ids = truncated_prompt(ids, req.truncate_prompt_tokens, self.max_model_len)
        field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = self._max_tokens(len(ids), req.max_completion_tokens or req.max_tokens, "messages", field)
        params = self._sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                       req.prompt_logprobs)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await self._add([(rid, ids, params)], req)
        if req.stream:
            return EventStreamResponse(self._chat_events(rid, created, streams, req, len(ids)),
                                       lambda: self._abort(streams, "client_disconnect"))
        out = (await self._collect(streams))[0]
        echo = self._chat_echo(req)
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=echo + c.text),
                              finish_reason=c.finish_reason,
                              logprobs=self._chat_logprobs(c.logprobs) if req.logprobs else None)
                   for c in out.outputs]
        body = ChatCompletionResponse(id=rid, created=created, model=self.model_name, choices=choices,
                                      usage=self._usage(len(ids), out.outputs, out.num_cached_tokens),
                                      prompt_logprobs=self._prompt_logprobs(out, req.prompt_logprobs))
        return Response(body.model_dump_json(), media_type="application/json")

    @staticmethod
    def _chat_echo(req: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's content, where that message has the reply's role (the assistant's,
        or with add_generation_prompt false the last message's own: the reply goes on with it)."""
        last = req.messages[-1]
        return last.text() if req.echo and (not req.add_generation_prompt or last.role == "assistant") else ""

    async def _chat_events(self, rid: str, created: int, streams: list[RequestStream], req: ChatCompletionRequest,
                           prompt_len: int) -> AsyncIterator[str]:
        include_usage, continuous = self._usage_options(req)
        exclude = None if include_usage else {"usage"}

        def chunk(choice: ChatChunkChoice, outputs: list[CompletionOutput]) -> str:
            c = ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[choice],
                                    usage=self._usage(prompt_len, outputs, cached) if continuous else None)
            return f"data: {c.model_dump_json(exclude=exclude)}\n\n"

        started = [False] * req.n
        sent_logprobs = [0] * req.n
        echo = self._chat_echo(req)
        finished: dict[int, CompletionOutput] = {}  # by index: the engine reports a finished choice at every step
        cached = 0
        try:                                          # until the whole group ends
            async for _, out in _merge(streams):
                cached = out.num_cached_tokens
                for c in out.outputs:
                    if c.index in finished:
                        continue
                    if not started[c.index]:
                        started[c.index] = True
                        yield chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content="")),
                                    [])
                        if echo:
                            yield chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(content=echo)), [])
                    lps = None
                    if req.logprobs and c.delta_token_ids:
                        new = c.logprobs[sent_logprobs[c.index]:sent_logprobs[c.index] + len(c.delta_token_ids)]
                        sent_logprobs[c.index] += len(new)
                        lps = self._chat_logprobs(new)
                    if c.delta_text or c.finish_reason or lps is not None:
                        yield chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(content=c.delta_text),
                                                    logprobs=lps, finish_reason=c.finish_reason), [c])
                    if c.finished:
                        finished[c.index] = c
            if include_usage:
                usage = ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[],
                                            usage=self._usage(prompt_len, list(finished.values()), cached))
                yield _event(usage)
            yield "data: [DONE]\n\n"
        except (RequestTimeoutError, RequestFailedError) as e:
            self._abort(streams, "error")
            yield sse_error(self._request_error(e))
            yield "data: [DONE]\n\n"

    # ---- responses --------------------------------------------------------------------------
    @_cancel_on_disconnect
    async def responses(self, req: ResponsesRequest) -> Response:
        """OpenAI's Responses API, text only: the instructions and input are a chat, rendered, checked and sampled
        by chat's rules (the model's sampling defaults, max_tokens), answered as one output message."""
        self._admit(req)
        ids = await self.chat_prompt_ids(req.conversation_messages(), fits=req.truncate_prompt_tokens is None,
                                         what="input")
        if req.truncate_prompt_tokens is not None:
            ids = truncated_prompt(ids, req.truncate_prompt_tokens, self.max_model_len)
        max_tokens = self._max_tokens(len(ids), req.max_output_tokens, "input", "max_output_tokens")
        params = self._sampling_params(req, max_tokens, None)
        start = started(req, self.model_name, params.temperature, params.top_p)
        streams = await self._add([(start.id, ids, params)], req)
        if req.stream:
            return EventStreamResponse(self._response_events(streams, ResponseEvents(start)),
                                       lambda: self._abort(streams, "client_disconnect"))
        out = (await self._collect(streams))[0]
        return Response(finished(start, message_id(), out).model_dump_json(), media_type="application/json")

    async def _response_events(self, streams: list[RequestStream], events: ResponseEvents) -> AsyncIterator[str]:
        for event in events.opening():
            yield event
        try:
            async for out in streams[0]:
                if out.outputs[0].delta_text:
                    yield events.delta(out.outputs[0].delta_text)
                if out.finished:
                    for event in events.closing(out):
                        yield event
        except (RequestTimeoutError, RequestFailedError) as e:
            self._abort(streams, "error")
            yield events.error(self._request_error(e))

    # ---- completions ------------------------------------------------------------------------
    async def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]],
                                  fits: str | None = None, add_special_tokens: bool = True) -> list[list[int]]:
        """fits and add_special_tokens: as encode's, for text prompts."""
        prompts = _prompt_list(prompt)
        if not prompts:
            raise APIError(400, "prompt is empty: give a string, a list of strings, or token ids", "prompt",
                           "empty_prompt")
        vocab = self.engine.engine.model_config.vocab_size
        ids = []
        for p in prompts:
            if isinstance(p, str):
                ids.append(await self.encode(p, add_special_tokens, fits))
                continue
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", "prompt", "invalid_value")
            ids.append(list(p))
        return ids

    @_cancel_on_disconnect
    async def completion(self, req: CompletionRequest) -> Response:
        self._admit(req)
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens must be at least 1; 0 is allowed only with echo: true, which returns "
                                "the prompt alone", "max_tokens", "invalid_value")
        prompts = await self._completion_prompts(req.prompt,
                                                 "prompt" if req.truncate_prompt_tokens is None else None,
                                                 req.add_special_tokens)
        if req.truncate_prompt_tokens is not None:
            prompts = [truncated_prompt(ids, req.truncate_prompt_tokens, self.max_model_len) for ids in prompts]
        requested = 1 if req.max_tokens == 0 else req.max_tokens  # the engine samples at least one token
        max_tokens = [self._max_tokens(len(ids), requested, "prompt") for ids in prompts]
        # an echoed prompt's tokens get logprobs too (OpenAI's legacy behaviour, vLLM's)
        echo_k = req.logprobs if req.echo else None
        prompt_k = max((k for k in (req.prompt_logprobs, echo_k) if k is not None), default=None)
        if len(set(max_tokens)) > 1:  # max_tokens null with prompts of several lengths: each gets its own budget
            params = [self._sampling_params(req, m, req.logprobs, prompt_k) for m in max_tokens]
        else:
            params = [self._sampling_params(req, max_tokens[0], req.logprobs, prompt_k)] * len(prompts)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await self._add([(f"{rid}-{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts, params))], req)
        prompt_len = sum(len(ids) for ids in prompts)
        echo = self._echo_texts(req, prompts)
        if req.stream:
            return EventStreamResponse(self._completion_events(rid, created, streams, req, prompt_len, echo),
                                       lambda: self._abort(streams, "client_disconnect"))
        outs = await self._collect(streams)
        choices, completions = [], []
        for i, out in enumerate(outs):
            for c in self._shown_outputs(req, out):
                completions.append(c)
                choices.append(CompletionChoice(
                    index=i * req.n + c.index, text=echo[i] + c.text, finish_reason=c.finish_reason,
                    logprobs=None if req.logprobs is None else self._completion_logprobs(
                        self._echoed_logprobs(req, out) + c.logprobs, 0, req.logprobs, out.prompt_token_ids[0]),
                    prompt_logprobs=self._prompt_logprobs(out, req.prompt_logprobs)))
        body = CompletionResponse(id=rid, created=created, model=self.model_name, choices=choices,
                                  usage=self._usage(prompt_len, completions,
                                                    sum(out.num_cached_tokens for out in outs)))
        return Response(body.model_dump_json(), media_type="application/json")

    @staticmethod
    def _shown_outputs(req: CompletionRequest, out: RequestOutput) -> list[CompletionOutput]:
        """The outputs a client sees. echo with max_tokens 0 (OpenAI's legacy way to score a prompt, vLLM's too)
        asks for the prompt alone: the one token the engine samples is left out, its text, logprob and count,
        and the choice ends as a limit of 0 tokens would, by length."""
        if not (req.echo and req.max_tokens == 0):
            return out.outputs
        return [CompletionOutput(index=c.index, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                                 finish_reason=c.finish_reason and "length") for c in out.outputs]

    @staticmethod
    def _echoed_logprobs(req: CompletionRequest, out: RequestOutput) -> list[Logprob | None]:
        """The prompt's logprobs that go before the completion's: all of them with echo, none without."""
        return list(out.prompt_logprobs or []) if req.echo else []

    def _echo_texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """With echo, each prompt's text as the client sent it (token ids or a truncated prompt: their decoded
        text, special tokens kept, as vLLM echoes them); "" for each without."""
        if not req.echo:
            return [""] * len(prompts)
        return [p if isinstance(p, str) and req.truncate_prompt_tokens is None
                else self.tokenizer.decode(ids, skip_special_tokens=False) for p, ids in zip(_prompt_list(req.prompt), prompts)]

    async def _completion_events(self, rid: str, created: int, streams: list[RequestStream], req: CompletionRequest,
                                 prompt_len: int, echo: list[str]) -> AsyncIterator[str]:
        include_usage, continuous = self._usage_options(req)
        exclude = None if include_usage else {"usage"}
        sent_logprobs: dict[int, int] = {}
        text_len: dict[int, int] = {}
        echoed: set[int] = set()
        cached: dict[int, int] = {}  # by prompt: its tokens the prefix cache served
        finished: dict[int, CompletionOutput] = {}  # by index: the engine reports a finished choice at every step
        try:                                          # until the whole group ends
            async for i, out in _merge(streams):
                cached[i] = out.num_cached_tokens
                for c in self._shown_outputs(req, out):
                    index = i * req.n + c.index
                    if index in finished:
                        continue
                    lps = None
                    first = index not in echoed  # the prompt goes first, in a choice's first chunk
                    if req.logprobs is not None and (c.delta_token_ids or first and req.echo):
                        start = sent_logprobs.get(index, 0)
                        new = c.logprobs[start:start + len(c.delta_token_ids)]
                        sent_logprobs[index] = start + len(new)
                        lps = self._completion_logprobs((self._echoed_logprobs(req, out) if first else []) + new,
                                                        text_len.get(index, 0), req.logprobs,
                                                        out.prompt_token_ids[0])
                        text_len[index] = text_len.get(index, 0) + sum(len(t) for t in lps.tokens)
                    prefix = echo[i] if first else ""
                    if prefix or c.delta_text or c.finish_reason or lps is not None:
                        echoed.add(index)
                        choice = CompletionChoice(index=index, text=prefix + c.delta_text, logprobs=lps,
                                                  finish_reason=c.finish_reason)
                        usage = self._usage(len(out.prompt_token_ids), [c], out.num_cached_tokens) \
                            if continuous else None
                        body = CompletionResponse(id=rid, created=created, model=self.model_name, choices=[choice],
                                                  usage=usage)
                        yield f"data: {body.model_dump_json(exclude=exclude)}\n\n"
                    if c.finished:
                        finished[index] = c
            if include_usage:
                yield _event(CompletionResponse(id=rid, created=created, model=self.model_name, choices=[],
                                                usage=self._usage(prompt_len, list(finished.values()),
                                                                  sum(cached.values()))))
            yield "data: [DONE]\n\n"
        except (RequestTimeoutError, RequestFailedError) as e:
            self._abort(streams, "error")
            yield sse_error(self._request_error(e))
            yield "data: [DONE]\n\n"

    @staticmethod
    def _usage_options(req: SamplingRequest) -> tuple[bool, bool]:
        """stream_options' include_usage, and vLLM's continuous_usage_stats (which takes effect with it)."""
        include = req.stream_options is not None and req.stream_options.include_usage
        return include, include and req.stream_options.continuous_usage_stats

    @staticmethod
    def _usage(prompt_len: int, outputs: list[CompletionOutput], cached: int) -> Usage:
        """cached: prompt tokens the prefix cache served (OpenAI's prompt_tokens_details.cached_tokens)."""
        completion = sum(len(c.token_ids) for c in outputs)
        return Usage(prompt_tokens=prompt_len, completion_tokens=completion, total_tokens=prompt_len + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
