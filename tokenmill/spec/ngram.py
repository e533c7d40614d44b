"""Prompt-lookup (n-gram) proposer: no extra model. The last n tokens of a request (n from prompt_lookup_max down
to prompt_lookup_min) are searched for earlier in its own prompt and output; the tokens that followed the
longest match (the most recent one among equals) are the draft. Wins where the output quotes its input:
summaries, edits, code changes, retrieval answers."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.request import Request


def ngram_lookup(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the longest earlier occurrence (n_min <= n <= n_max) of the last n tokens."""
    size = len(tokens)
    if size < n_min + 1 or k <= 0:
        return []
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])   # candidate match ends, before the last token
    length = 1
    while ends.size and length < n_max:
        ok = ends >= length
        ok[ok] = tokens[ends[ok] - length] == tokens[size - 1 - length]
        if not ok.any():
            break
        ends = ends[ok]
        length += 1
    if length < n_min or not ends.size:
        return []
    start = int(ends[-1]) + 1
    return tokens[start: start + k].tolist()


class NgramProposer:
    """Drafts are point masses (no q): the rejection sampler accepts a draft x with probability p(x)."""

    one_off_seconds = 0.0   # no work that steady decoding would not repeat

    def __init__(self, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.n_max, self.n_min = prompt_lookup_max, prompt_lookup_min

    def propose(self, reqs: list[Request], num_tokens: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        drafts = [ngram_lookup(np.asarray(r.all_token_ids), k, self.n_max, self.n_min)
                  for r, k in zip(reqs, num_tokens)]
        return drafts, [None] * len(reqs)

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""
