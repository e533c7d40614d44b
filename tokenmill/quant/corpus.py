"""The text every quantization tool reads, and a way to run a model over it.

English that needs no download: the Python documentation topics shipped with the interpreter (pydoc_data).
quant-eval scores windows from its start; GPTQ calibrates on windows from its end (half of them rendered as
chat turns for a chat model), so the two never overlap.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.layers.attention import AttentionMetadata, PagedAttention, forward_context
from tokenmill.quant.kv_cache import kv_row_width

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

EVAL_BLOCK_SIZE = 16


def corpus_text() -> str:
    """The Python documentation topics bundled with the interpreter, in a fixed order."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def corpus_windows(token_ids: list[int], num_tokens: int, window: int, from_end: bool = False) -> list[list[int]]:
    """The first (or with from_end the last) num_tokens ids cut into windows of `window` (the last may be
    shorter, but not below 2)."""
    ids = token_ids[-num_tokens:] if from_end else token_ids[:num_tokens]
    if len(ids) < 2:
        raise ValueError(f"the corpus gave {len(ids)} tokens; need at least 2")
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) >= 2]


class WindowRunner:
    """Runs a model over one sequence at a time through a paged cache of its own; returns log-probs."""

    def __init__(self, model: nn.Module, window: int, device: torch.device, cache_dtype: torch.dtype) -> None:
        self.model, self.device = model, device
        num_blocks = -(-window // EVAL_BLOCK_SIZE)
        self.block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
        self.caches = {}
        for m in model.modules():
            if isinstance(m, PagedAttention):
                shape = (num_blocks, EVAL_BLOCK_SIZE, m.num_kv_heads, kv_row_width(m.head_dim, cache_dtype))
                self.caches[m] = (torch.zeros(shape, dtype=cache_dtype, device=device),
                                  torch.zeros(shape, dtype=cache_dtype, device=device))

    @torch.inference_mode()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """float32 log-softmax over the vocabulary for every position of `ids` [len(ids), vocab], on the CPU."""
        for m, (k, v) in self.caches.items():
            m.k_cache, m.v_cache = k, v
        n = len(ids)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_tables=self.block_table, max_query_len=n, max_seq_len=n)
        with forward_context(meta):
            hidden = self.model(torch.tensor(ids, device=self.device), torch.arange(n, device=self.device))
        return torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1).cpu()


def calibration_windows(tokenizer: Tokenizer, num_tokens: int, window: int) -> list[list[int]]:
    """Calibration sequences from the end of the corpus. For a chat model every other window is rendered as a
    conversation (its first half a user turn, its second half the assistant's answer), so the special tokens
    and turn structure the model is served with are calibrated too, not only plain prose."""
    ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    windows = corpus_windows(ids, num_tokens, window, from_end=True)
    if not tokenizer.chat_template:
        return windows
    for i in range(1, len(windows), 2):
        half = len(windows[i]) // 2
        turns = [{"role": "user", "content": tokenizer.decode(windows[i][:half])},
                 {"role": "assistant", "content": tokenizer.decode(windows[i][half:])}]
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=False)
        windows[i] = tokenizer.encode(text, add_special_tokens=False)[:window]
    return windows
