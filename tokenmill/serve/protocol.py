"""Request and response bodies of the API: OpenAI's shapes plus tokenmill's extra sampling fields.

They are the contract: FastAPI validates every request against them (strictly: "1" is not a number, true is not
an integer) and publishes them at /openapi.json. OpenAI and vLLM fields that tokenmill does not implement are
declared too, so that a request setting one is refused (`unsupported()`) rather than answered as if it had been
honoured; other unknown fields are ignored, as OpenAI-compatible servers do."""
from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from tokenmill.request import PRIORITY_LIMIT

MAX_STOP_TOKEN_IDS = 1024  # the engine looks a request's stop ids up at every step: a huge list slows every user
MAX_STOP_STRINGS = 1024  # and searches the new text for each stop string at every step
MAX_BAD_WORDS = 1024  # spelled in tokens on the engine's thread, and matched against the output at every step
# vLLM's structured-output fields: constrained decoding, which tokenmill does not implement
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


class _Request(BaseModel):
    # NaN and Infinity (which Python's JSON reads) are refused as "not a finite number", not checked against a
    # field's bounds, where NaN read "should be less than or equal to 2" and Infinity passed a lower bound alone
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """OpenAI's optional fields are nullable, and its client sends a field passed as None as null
        (`temperature=None`): null on an optional field that does not take None means its default."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()
                or type(None) in get_args(fields[k].annotation)}


def _utf8(text: str) -> str:
    """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text: a lone surrogate ({text[e.start]!a}) at character {e.start}") \
            from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]  # text that reaches the tokenizer


def _truncation(k: int) -> int:
    """vLLM's truncate_prompt_tokens: -1 is the model's context length; 0 would keep no token."""
    if k == 0 or k < -1:
        raise ValueError("must be -1 (the model's context length) or at least 1")
    return k


# ---- errors ---------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- shared request fields --------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = Field(False, description="send a last chunk with the usage of the whole request")
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk also carries "
                                                            "the usage of its choice so far")


class SamplingRequest(_Request):
    model: str | None = Field(None, description="the served model's name; default: the served model")
    n: int = Field(1, ge=1, le=128, description="completions to generate for each prompt")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="stop strings, not included in the output")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int = Field(-1, ge=-1, description="tokenmill: keep the k most likely tokens; -1 or 0 keeps all")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="tokenmill: drop tokens below min_p x the top probability")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="tokenmill: penalty on tokens already seen")
    ignore_eos: bool = Field(False, description="tokenmill: keep generating past the end-of-sequence token")
    min_tokens: int = Field(0, ge=0, description="vLLM's: EOS, stop_token_ids and stop strings cannot end the output "
                                                 "before this many tokens; at most max_tokens")
    stop_token_ids: list[int] | None = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS,
        description="vLLM's: token ids that end the output, their text left out unless include_stop_str_in_output")
    include_stop_str_in_output: bool = Field(False, description="vLLM's: keep the stop string or stop token's text")
    skip_special_tokens: bool = Field(True, description="vLLM's: leave special tokens out of the output text")
    priority: int = Field(0, ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT,
                          description="tokenmill: lower runs first under --scheduling-policy priority")
    timeout_s: float | None = Field(None, gt=0.0, description="tokenmill: abort the request after this many seconds")
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (a string of digits) -> bias in [-100, 100], added to its logit before sampling")
    allowed_token_ids: list[int] | None = Field(None, min_length=1,
                                                description="vLLM's: only these token ids can be sampled")
    bad_words: list[Text] | None = Field(None, max_length=MAX_BAD_WORDS,
                                         description="vLLM's: words the output may not contain (a word's last token "
                                                     "cannot follow the rest of its tokens)")
    truncate_prompt_tokens: Annotated[int, AfterValidator(_truncation)] | None = Field(
        None, description="vLLM's: keep only the prompt's last this many tokens (-1: the model's context length)")
    response_format: dict[str, Any] | None = Field(None, description='not supported beyond {"type": "text"}')
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="vLLM's: the logprob and rank of each prompt "
                                                                     "token and its k likeliest alternatives "
                                                                     "(not with stream)")
    use_beam_search: bool = Field(False, description="vLLM's; not supported: refused unless false")
    return_tokens_as_token_ids: bool = Field(False, description="vLLM's; not supported: refused unless false")
    return_token_ids: bool = Field(False, description="vLLM's; not supported: refused unless false")
    # GUIDED_FIELDS, typed Any so that every non-null value is refused by name, not failed as a wrong type
    guided_json: Any = Field(None, description="vLLM's; not supported: refused unless null")
    guided_regex: Any = Field(None, description="vLLM's; not supported: refused unless null")
    guided_choice: Any = Field(None, description="vLLM's; not supported: refused unless null")
    guided_grammar: Any = Field(None, description="vLLM's; not supported: refused unless null")
    structured_outputs: Any = Field(None, description="vLLM's; not supported: refused unless null")

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, message) for each field set to something tokenmill does not implement."""
        out = []
        if self.response_format is not None and self.response_format.get("type") != "text":
            out.append(("response_format", f"response_format {self.response_format!r} is not supported: tokenmill "
                                           'generates free text only; omit it or send {"type": "text"}'))
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: they come with the whole response
            out.append(("prompt_logprobs", "prompt_logprobs is not supported with stream: true (as in vLLM, they "
                                           "come with the whole response); omit it or send stream: false"))
        if self.use_beam_search:
            out.append(("use_beam_search", "use_beam_search is not supported: tokenmill samples, it does not search "
                                           "beams; omit use_beam_search"))
        if self.return_tokens_as_token_ids:
            out.append(("return_tokens_as_token_ids", "return_tokens_as_token_ids is not supported: logprobs name "
                                                      "tokens by their text; omit return_tokens_as_token_ids"))
        if self.return_token_ids:
            out.append(("return_token_ids", "return_token_ids is not supported: responses carry text (/tokenize gives "
                                            "a text's token ids); omit return_token_ids"))
        for name in GUIDED_FIELDS:
            if getattr(self, name) is not None:
                out.append((name, f"{name} is not supported: tokenmill does not implement constrained decoding, "
                                  f"and the output would not follow it; omit {name}"))
        return out


# ---- chat completions -----------------------------------------------------------------------------
class TextContentPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = Field(False, description="vLLM's: the tokenizer's special tokens (a BOS) added to the "
                                                        "rendered chat, which its template usually holds already")
    echo: bool = Field(False, description="vLLM's: begin the reply with the last message's content when that "
                                          "message has the reply's role (assistant; with add_generation_prompt "
                                          "false, the last message's own)")
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI; use max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: what the context leaves")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, description="not supported: refused unless null or empty")
    tool_choice: str | dict[str, Any] | None = Field(None, description='not supported: refused unless null or "none"')
    functions: list[dict[str, Any]] | None = Field(None, description="deprecated by OpenAI; not supported: refused "
                                                                     "unless null or empty")
    function_call: str | dict[str, Any] | None = Field(None, description='deprecated by OpenAI; not supported: '
                                                                         'refused unless null or "none"')
    add_generation_prompt: bool = Field(True, description="vLLM's: end the prompt with the assistant turn's header")
    continue_final_message: bool = Field(False, description="vLLM's: go on with the last message (a prefilled "
                                                            "answer); needs add_generation_prompt false")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's: more variables for the chat "
                                                                      "template (e.g. enable_thinking)")
    chat_template: str | None = Field(None, description="vLLM's: a jinja2 chat template used instead of the "
                                                        "server's; refused unless the server was started with "
                                                        "--trust-request-chat-template")

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                out.append((name, f"{name} is not supported: tokenmill does not implement tool calling; omit {name}"))
        for name in ("tool_choice", "function_call"):
            value = getattr(self, name)
            if value is not None and value != "none":
                out.append((name, f"{name} {value!r} is not supported: tokenmill does not implement tool calling; "
                                  f'omit {name} or send "none"'))
        return out


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token or an alternative at one prompt position."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # a prompt position's token ids (as strings) -> entries


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- completions ------------------------------------------------------------------------------------
class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]] = Field(
        description="a prompt, a list of prompts, or token ids (one list or a list of lists)")
    max_tokens: int | None = Field(16, ge=0, description="null: what the context leaves; 0 only with echo: the "
                                                          "prompt alone (with logprobs, its tokens scored)")
    logprobs: int | None = Field(None, ge=0, le=20, description="also return the top-k alternatives per token")
    add_special_tokens: bool = Field(True, description="vLLM's: the tokenizer's special tokens (a BOS) added to a "
                                                       "text prompt; token ids are taken as they are")
    suffix: str | None = Field(None, description="not supported: refused unless null")
    best_of: int | None = Field(None, description="not supported: refused unless null or equal to n")
    echo: bool = Field(False, description="return the prompt's text (with logprobs: its tokens' logprobs) before "
                                          "each completion")

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.suffix is not None:
            out.append(("suffix", "suffix is not supported: tokenmill completes a prompt, it does not insert text; "
                                  "omit suffix"))
        if self.best_of is not None and self.best_of != self.n:
            out.append(("best_of", f"best_of={self.best_of} is not supported: every sample is returned; omit "
                                   "best_of or set it to n"))
        return out


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token: nothing precedes it
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- models, tokenizer, version -------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = Field(False, description="vLLM's: also return each token's string in the vocabulary")


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    return_token_strs: bool = Field(False, description="vLLM's: also return each token's string in the vocabulary")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = Field(None, description="with return_token_strs: each token's string")


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"
