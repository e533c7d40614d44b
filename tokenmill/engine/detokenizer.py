"""Incremental detokenization and stop checks for one request.

New text is produced by decoding a small window of recent tokens (vLLM's prefix/read offsets), so the
cost per token is constant and multi-byte characters split across tokens never appear half-made.
While a request runs, the last len(longest stop string) - 1 characters are held back from the stream,
so a stop string split across tokens is never leaked to the client."""
from __future__ import annotations

from tokenmill.request import Request, RequestStatus
from tokenmill.tokenizer import Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, request: Request) -> None:
        self.tokenizer = tokenizer
        self.request = request
        self.skip_special = request.sampling_params.skip_special_tokens
        n = request.num_prompt_tokens
        self.prefix_offset = max(n - 5, 0)
        self.read_offset = n
        stops = request.sampling_params.stop
        self.hold = max((len(s) for s in stops), default=1) - 1

    def append(self, num_new: int) -> None:
        """Decode the request's newest num_new tokens into request.output_text."""
        ids = self.request.all_token_ids
        for end in range(len(ids) - num_new + 1, len(ids) + 1):
            window = ids[self.prefix_offset:end]
            prefix = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset], self.skip_special)
            text = self.tokenizer.decode(window, self.skip_special)
            if len(text) > len(prefix) and not text.endswith("\ufffd"):
                self.request.output_text += text[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, end

    def check_stop_string(self, num_new_chars: int) -> str | None:
        """Find a stop string in the newest text; on a hit, truncate the output and return it."""
        req = self.request
        stops = req.sampling_params.stop
        if not stops:
            return None
        text = req.output_text
        start = max(0, len(text) - num_new_chars - self.hold)
        best = None
        for s in stops:
            idx = text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        req.output_text = text[: idx + len(s)] if req.sampling_params.include_stop_str_in_output else text[:idx]
        return s

    def streamable_text(self) -> str:
        """Text safe to send now: everything once finished, else all but the held-back tail."""
        text = self.request.output_text
        if self.request.status.finished or self.hold == 0:
            return text
        return text[: max(len(text) - self.hold, self.request.sent_text_len)]


def check_stop(request: Request, eos_token_ids: list[int], max_model_len: int) -> tuple[RequestStatus, int | None] | None:
    """Stop by token id, max_tokens or context length, judged on the newest token."""
    p = request.sampling_params
    token = request.output_token_ids[-1]
    if request.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and token in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if p.max_tokens is not None and request.num_output_tokens >= p.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None
