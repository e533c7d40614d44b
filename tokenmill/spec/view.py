"""A request seen with some draft tokens appended, for code that reads a Request: the target's sampler scoring
draft positions (penalties and min_tokens count the drafts before each position) and the draft model's runner
running ahead of the confirmed tokens. Token lists are built only when read."""
from __future__ import annotations

from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams


class DraftedView:
    def __init__(self, request: Request, drafts: list[int], num_computed_tokens: int = 0,
                 sampling_params: SamplingParams | None = None) -> None:
        self.request = request
        self.drafts = drafts
        self.num_computed_tokens = num_computed_tokens
        self.request_id = request.request_id
        self.sampling_params = sampling_params or request.sampling_params

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.drafts if self.drafts else self.request.all_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts if self.drafts else self.request.output_token_ids

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens + len(self.drafts)

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)
