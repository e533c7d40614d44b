"""The Responses API's shapes over the engine's outputs: the response object of a finished request, and the events
of a streamed one in OpenAI's order, each named by its type and numbered from 0. The engine side (admission, the
engine request, disconnects, errors, metrics) is OpenAIServing's, shared with chat (serving.responses)."""
from __future__ import annotations

import time
import uuid

from pydantic import BaseModel

from tokenmill.outputs import RequestOutput
from tokenmill.serve.errors import APIError
from tokenmill.serve.protocol import ErrorInfo
from tokenmill.serve.responses_protocol import (ContentPartEvent, ErrorEvent, IncompleteDetails, InputTokensDetails,
                                                OutputItemEvent, OutputMessage, OutputText, ResponsesRequest,
                                                ResponsesResponse, ResponseStateEvent, ResponseUsage, TextDeltaEvent,
                                                TextDoneEvent)


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def started(req: ResponsesRequest, model: str, temperature: float, top_p: float) -> ResponsesResponse:
    """The response before any output, the request's settings echoed. temperature and top_p: those sampled with
    (the model's defaults where the request left them unset)."""
    return ResponsesResponse(id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()), status="in_progress",
                             instructions=req.instructions, max_output_tokens=req.max_output_tokens, model=model,
                             output=[], parallel_tool_calls=req.parallel_tool_calls, temperature=temperature,
                             tool_choice=req.tool_choice or "auto", top_p=top_p, user=req.user,
                             metadata=req.metadata or {})


def finished(start: ResponsesResponse, item_id: str, out: RequestOutput) -> ResponsesResponse:
    """The response once its request has finished: incomplete where the length limit ended the output (the
    request's max_output_tokens, or the context's), else completed."""
    c = out.outputs[0]
    status = "incomplete" if c.finish_reason == "length" else "completed"
    prompt_len, output_len = len(out.prompt_token_ids), len(c.token_ids)
    usage = ResponseUsage(input_tokens=prompt_len,
                          input_tokens_details=InputTokensDetails(cached_tokens=out.num_cached_tokens),
                          output_tokens=output_len, total_tokens=prompt_len + output_len)
    message = OutputMessage(id=item_id, status=status, content=[OutputText(text=c.text)])
    return start.model_copy(update={"status": status, "output": [message], "usage": usage,
                                    "incomplete_details": IncompleteDetails() if status == "incomplete" else None})


class ResponseEvents:
    """The server-sent events of one streamed response: `event: <type>` and `data: <event JSON>`, whose
    sequence_number counts from 0. OpenAI sends no [DONE] after the last."""

    def __init__(self, start: ResponsesResponse) -> None:
        self.start = start
        self.item_id = message_id()
        self._sequence = 0

    def _send(self, event_type: type[BaseModel], **fields: object) -> str:
        event = event_type(sequence_number=self._sequence, **fields)
        self._sequence += 1
        return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"  # type: ignore[attr-defined]

    def _place(self) -> dict[str, object]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def opening(self) -> list[str]:
        """Created and in progress, then the output message and its text part, both empty."""
        return [self._send(ResponseStateEvent, type="response.created", response=self.start),
                self._send(ResponseStateEvent, type="response.in_progress", response=self.start),
                self._send(OutputItemEvent, type="response.output_item.added", output_index=0,
                           item=OutputMessage(id=self.item_id, status="in_progress", content=[])),
                self._send(ContentPartEvent, type="response.content_part.added", part=OutputText(text=""),
                           **self._place())]

    def delta(self, text: str) -> str:
        return self._send(TextDeltaEvent, delta=text, **self._place())

    def closing(self, out: RequestOutput) -> list[str]:
        """The text, its part and its message done, then the whole response, completed or incomplete."""
        final = finished(self.start, self.item_id, out)
        message = final.output[0]
        text = message.content[0]
        return [self._send(TextDoneEvent, text=text.text, **self._place()),
                self._send(ContentPartEvent, type="response.content_part.done", part=text, **self._place()),
                self._send(OutputItemEvent, type="response.output_item.done", output_index=0, item=message),
                self._send(ResponseStateEvent, type=f"response.{final.status}", response=final)]

    def error(self, err: APIError) -> str:
        return self._send(ErrorEvent, code=err.code, message=err.message, param=err.param,
                          error=ErrorInfo(**err.body()["error"]))
