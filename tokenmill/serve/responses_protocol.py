"""Request and response bodies of OpenAI's Responses API (`POST /v1/responses`), text only, as vLLM serves it.

The request is a chat request in other words: its sampling fields are SamplingRequest's, so that tokenmill's and
vLLM's extras and the model's sampling defaults apply as they do to chat. What the Responses API adds beyond text
generation (stored responses and conversations, tools, reasoning, structured output, images and files) is declared
so that a request asking for it is refused by name (`unsupported()`) rather than answered as if it had been
honoured."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag

from tokenmill.serve.protocol import ChatMessage, ErrorInfo, SamplingRequest, Text, _Request

MAX_METADATA_PAIRS = 16  # OpenAI's limits on metadata, which is echoed back
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
_PARTS = 'text parts {"type": "input_text", "text": ...}'  # in the error of a content of neither type


def _tagged(supported: tuple[str, ...], default: str | None) -> Discriminator:
    """An input item or content part of a supported type is validated as such; any other dict (a function call,
    an image) is kept as Unsupported, which unsupported() refuses by name, not failed as a malformed message."""
    def tag(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else default
        return "Supported" if kind in supported or not isinstance(value, dict) else "Unsupported"
    return Discriminator(tag)


def _str_or_list(value: Any) -> str | None:
    """A message's content is one or the other: any other value gets one error saying so, and a list's errors are
    its own (a union of the two reported "should be a valid string" for a list with a bad part)."""
    return "str" if isinstance(value, str) else "list" if isinstance(value, list) else None


class Unsupported(_Request):
    """An input item or content part of a type tokenmill does not take."""

    type: Any = None


class InputText(_Request):
    type: Literal["input_text", "output_text"]  # output_text: an earlier response's message sent back
    text: Text


InputPart = Annotated[Union[Annotated[InputText, Tag("Supported")], Annotated[Unsupported, Tag("Unsupported")]],
                      _tagged(("input_text", "output_text"), None)]


class InputMessage(_Request):
    """OpenAI's EasyInputMessage, and the message items of an earlier response's output sent back (their id and
    status are ignored)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[Union[Annotated[Text, Tag("str")], Annotated[list[InputPart], Tag("list")]],
                       Discriminator(_str_or_list, custom_error_type="invalid_type",
                                     custom_error_message=f"must be a string or a list of {_PARTS}")]

    def chat_message(self) -> ChatMessage:
        """As a chat message: text parts joined by newlines, as ChatMessage joins its own."""
        if isinstance(self.content, str):
            return ChatMessage(role=self.role, content=self.content)
        return ChatMessage(role=self.role, content="\n".join(p.text for p in self.content))  # type: ignore[union-attr]


InputItem = Annotated[Union[Annotated[InputMessage, Tag("Supported")], Annotated[Unsupported, Tag("Unsupported")]],
                      _tagged(("message",), "message")]
# the tags name the members in error messages: "must be a string or a list of messages"
Input = Union[Annotated[Text, Tag("str")], Annotated[list[InputItem], Field(min_length=1), Tag("list[messages]")]]
MetadataKey = Annotated[Text, Field(max_length=MAX_METADATA_KEY)]
MetadataValue = Annotated[Text, Field(max_length=MAX_METADATA_VALUE)]


class ResponsesRequest(SamplingRequest):
    input: Input = Field(description="a user message's text, or a list of messages {role, content} (content: "
                                     "text, or input_text / output_text parts)")
    instructions: Text | None = Field(None, description="a system message put before the input")
    max_output_tokens: int | None = Field(None, ge=1, description="default: what the context leaves, or the "
                                                                  "model's max_new_tokens")
    user: Text | None = None  # echoed back, so it must be text that JSON can carry
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_PAIRS)] | None = Field(
        None, description="echoed back in the response")
    store: bool | None = Field(None, description="accepted; tokenmill stores no response")
    parallel_tool_calls: bool = Field(True, description="echoed back; there are no tool calls")
    truncation: Literal["auto", "disabled"] | None = Field(None, description='not supported beyond "disabled"')
    tools: list[dict[str, Any]] | None = Field(None, description="not supported: refused unless null or empty")
    tool_choice: str | dict[str, Any] | None = Field(None, description='not supported beyond "none" and "auto"')
    text: dict[str, Any] | None = Field(None, description='not supported beyond {"format": {"type": "text"}, '
                                                          '"verbosity": "medium"}')
    reasoning: dict[str, Any] | None = Field(None, description='not supported: refused with an effort other than '
                                                               '"none" or a summary')
    include: list[Any] | None = Field(None, description="not supported: refused unless null or empty")
    background: bool | None = Field(None, description="not supported: refused unless false")
    # typed Any, as GUIDED_FIELDS are, so that every non-null value is refused by name
    previous_response_id: Any = Field(None, description="not supported (nothing is stored): refused unless null")
    conversation: Any = Field(None, description="not supported (nothing is stored): refused unless null")
    prompt: Any = Field(None, description="not supported (stored prompts): refused unless null")

    def conversation_messages(self) -> list[ChatMessage]:
        """The chat the model sees: the instructions as a system message, then the input."""
        head = [] if self.instructions is None else [ChatMessage(role="system", content=self.instructions)]
        if isinstance(self.input, str):
            return [*head, ChatMessage(role="user", content=self.input)]
        return [*head, *(m.chat_message() for m in self.input)]  # type: ignore[union-attr]

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.n != 1:
            out.append(("n", f"n={self.n} is not supported on /v1/responses: a response holds one message; omit n"))
        if self.prompt_logprobs is not None:
            out.append(("prompt_logprobs", "prompt_logprobs is not supported on /v1/responses: a response has no "
                                           "place for them; omit prompt_logprobs"))
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            out.append(("stream_options", "stream_options.continuous_usage_stats is not supported on /v1/responses: "
                                          "the usage comes in the last event; omit it"))
        for name, what in {"previous_response_id": "responses", "conversation": "conversations",
                           "prompt": "prompts"}.items():
            if getattr(self, name) is not None:
                out.append((name, f"{name} is not supported: tokenmill stores no {what}; send the whole conversation "
                                  f"as input, and omit {name}"))
        if self.background:
            out.append(("background", "background is not supported: responses are answered while the request "
                                      "waits (or streamed); omit background or send false"))
        if self.tools:
            out.append(("tools", "tools is not supported: tokenmill does not implement tool calling; omit tools"))
        if self.tool_choice is not None and self.tool_choice not in ("none", "auto"):
            out.append(("tool_choice", f"tool_choice {self.tool_choice!r} is not supported: tokenmill does not "
                                       'implement tool calling; omit tool_choice or send "none" or "auto"'))
        if self.text is not None:
            fmt = self.text.get("format")
            if fmt is not None and fmt != {"type": "text"}:
                out.append(("text.format", f"text.format {fmt!r} is not supported: tokenmill generates free text "
                                           'only; omit it or send {"type": "text"}'))
            verbosity = self.text.get("verbosity")
            if verbosity not in (None, "medium"):  # OpenAI's default: what any model does unasked
                out.append(("text.verbosity", f"text.verbosity {verbosity!r} is not supported: tokenmill does not "
                                              'steer the output\'s length; omit it or send "medium" '
                                              "(max_output_tokens caps the length)"))
        if self.reasoning is not None:
            for name in ("effort", "summary", "generate_summary"):
                value = self.reasoning.get(name)
                if value is not None and not (name == "effort" and value == "none"):
                    out.append((f"reasoning.{name}", f"reasoning.{name} {value!r} is not supported: tokenmill does "
                                                     "not implement reasoning models' options; omit reasoning"))
        if self.include:
            out.append(("include", f"include {self.include!r} is not supported: a response holds its message's "
                                   "text only; omit include"))
        if self.truncation == "auto":
            out.append(("truncation", 'truncation "auto" is not supported: a conversation longer than the context is '
                                      'refused; omit truncation or send "disabled" (truncate_prompt_tokens, vLLM\'s, '
                                      "keeps the prompt's last tokens)"))
        out += self._unsupported_input()
        return out

    def _unsupported_input(self) -> list[tuple[str, str]]:
        if isinstance(self.input, str):
            return []
        out = []
        for i, item in enumerate(self.input):
            if isinstance(item, Unsupported):
                out.append((f"input.{i}", f"input.{i} (an item of type {item.type!r}) is not supported: tokenmill "
                                          "takes messages of text only; send the conversation as messages"))
                continue
            for j, part in enumerate(item.content if isinstance(item.content, list) else []):
                if isinstance(part, Unsupported):
                    out.append((f"input.{i}.content.{j}", f"input.{i}.content.{j} (a part of type {part.type!r}) "
                                                          "is not supported: tokenmill takes text only; send "
                                                          "input_text parts"))
        return out


# ---- the response ------------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")
    cache_write_tokens: int = Field(0, description="OpenAI's explicit prompt-cache writes: none (the prefix cache "
                                                   "is implicit)")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponsesResponse(BaseModel):
    """The response object, with the request's settings echoed as OpenAI echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None  # a failure is an HTTP error, or a stream's error event
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    temperature: float
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Literal["none", "auto"]
    tools: list[Any] = Field(default_factory=list)
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None
    metadata: dict[str, str]
    background: bool = False


# ---- streaming events ------------------------------------------------------------------------------
class _Event(BaseModel):
    type: str  # each event's own literal; first in the JSON, as OpenAI sends it
    sequence_number: int


class ResponseStateEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponsesResponse


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputMessage


class _ContentEvent(_Event):
    """An event about the output message's content part (there is one of each)."""

    item_id: str
    output_index: int
    content_index: int


class ContentPartEvent(_ContentEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    part: OutputText


class TextDeltaEvent(_ContentEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(_ContentEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ErrorEvent(_Event):
    """OpenAI's error event, carrying the other endpoints' error object too: OpenAI's client raises a stream event
    that has one (openai.APIError), as it does a chat stream's error."""

    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None
    error: ErrorInfo
