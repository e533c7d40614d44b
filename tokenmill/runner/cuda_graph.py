"""CUDA graphs for decode steps: one graph per batch-size bucket, captured once with padding, all
sharing one memory pool. A decode step of b requests replays the smallest bucket >= b."""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from tokenmill.layers.attention import AttentionMetadata, forward_context

if TYPE_CHECKING:
    from tokenmill.runner.model_runner import ModelRunner


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    out = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
    return sorted(set(out))


class CUDAGraphRunner:
    def __init__(self, runner: "ModelRunner", max_num_seqs: int) -> None:
        self.runner = runner
        self.buckets = batch_buckets(max_num_seqs)
        n, dev = self.buckets[-1], runner.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, runner.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self._capture_all()

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[: b + 1],
                                 seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b],
                                 max_query_len=1, max_seq_len=self.runner.max_model_len)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model = self.runner.model
        for b in reversed(self.buckets):
            meta = self._meta(b)
            with forward_context(meta):
                model(self.input_ids[:b], self.positions[:b])  # warm-up: compiles kernels for this shape
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[b] = model(self.input_ids[:b], self.positions[:b])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def fits(self, num_seqs: int, meta: AttentionMetadata) -> bool:
        return num_seqs <= self.buckets[-1] and meta.block_tables.shape[1] <= self.block_tables.shape[1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:b] = -1
        self.seq_lens[:n] = meta.seq_lens
        self.seq_lens[n:b] = 1
        w = meta.block_tables.shape[1]
        self.block_tables[:n, :w] = meta.block_tables
        self.block_tables[:n, w:] = 0
        self.block_tables[n:b] = 0
        self.graphs[b].replay()
        return self.outputs[b]
