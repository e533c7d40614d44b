"""Request and response bodies of the API: OpenAI's shapes plus tokenmill's extra sampling fields.

They are the contract: FastAPI validates every request against them (strictly: "1" is not a number, true is not
an integer) and publishes them at /openapi.json. Unknown fields are ignored, as OpenAI-compatible servers do."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from tokenmill.request import PRIORITY_LIMIT


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _utf8(text: str) -> str:
    """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text: a lone surrogate ({text[e.start]!a}) at character {e.start}") \
            from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]  # text that reaches the tokenizer


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


class SamplingRequest(_Request):
    model: str | None = Field(None, description="the served model's name; default: the served model")
    n: int = Field(1, ge=1, le=128, description="completions to generate for each prompt")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: Text | list[Text] | None = Field(None, description="stop strings, not included in the output")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int = Field(-1, ge=-1, description="tokenmill: keep the k most likely tokens; -1 or 0 keeps all")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="tokenmill: drop tokens below min_p x the top probability")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="tokenmill: penalty on tokens already seen")
    ignore_eos: bool = Field(False, description="tokenmill: keep generating past the end-of-sequence token")
    priority: int = Field(0, ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT,
                          description="tokenmill: lower runs first under --scheduling-policy priority")
    timeout_s: float | None = Field(None, gt=0.0, description="tokenmill: abort the request after this many seconds")


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
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI; use max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: what the context leaves")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


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
    max_tokens: int | None = Field(16, ge=1, description="null: what the context leaves")
    logprobs: int | None = Field(None, ge=0, le=20, description="also return the top-k alternatives per token")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


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


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"
