"""CUDA graphs for decode steps: one graph per batch-size bucket, captured once with padding, all
sharing one memory pool. A decode step of b requests replays the smallest bucket >= b.

The graphs read their inputs from one device buffer with a fixed layout (token ids, positions, slots, the rows
of async scheduling's pending tokens, context lengths, block tables), filled by a single copy from its pinned
host twin, so a step costs one copy and one graph launch of host time. A graph's first kernel puts the tokens
the previous step sampled (the runner's `sampled` buffer) in place of their placeholders. Graphs of small
buckets end with the LM head, so that it starts as the last layer ends instead of after the host launches it."""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from tokenmill.distributed import on_destroy, tp_size
from tokenmill.layers.attention import AttentionMetadata, forward_context
from tokenmill.runner.staging import StagingBuffer

if TYPE_CHECKING:
    from tokenmill.runner.model_runner import ModelInput, ModelRunner


# Buckets up to this size also run the LM head. Their float32 logits stay in the graph pool: 31 rows over the
# buckets 1-16, 16 MB for Llama-3's 128,256 tokens, beside the pool's activations (outside the KV budget, like
# them); a batch-256 bucket would hold 131 MB more for a boundary that is a thousandth of its step.
LOGITS_MAX_BATCH = 16


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    out = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
    return sorted(set(out))


class CUDAGraphRunner:
    def __init__(self, runner: "ModelRunner", max_num_seqs: int) -> None:
        self.runner = runner
        self.buckets = batch_buckets(max_num_seqs)
        n, width = self.buckets[-1], runner.max_blocks_per_seq
        # Layout of the input buffer; the block tables come last so a bucket copies only its own rows.
        self.tables_at, self.row_bytes = 32 * n + 8 * -(-n // 2), 4 * width
        layout = {"input_ids": (0, torch.int64, (n,)), "positions": (8 * n, torch.int64, (n,)),
                  "slot_mapping": (16 * n, torch.int64, (n,)), "token_src": (24 * n, torch.int64, (n,)),
                  "seq_lens": (32 * n, torch.int32, (n,)), "block_tables": (self.tables_at, torch.int32, (n, width))}
        self.staging = StagingBuffer(runner.device, self.tables_at + n * self.row_bytes)
        self.host = {k: self.staging.host_view(*spec) for k, spec in layout.items()}
        self.dev = {k: self.staging.view(*spec) for k, spec in layout.items()}
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=runner.device)
        self._pad(0, n)
        self.staging.copy(self.staging.host.numel())
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        if tp_size() > 1:  # registered first: a capture that fails part way still releases what it captured
            on_destroy(self.release)
        self._capture_all()

    def _pad(self, start: int, end: int) -> None:
        """Rows start..end of the host buffer become padding: token 0 at position 0, no cache write, context 1."""
        h = self.host
        h["input_ids"][start:end] = 0
        h["token_src"][start:end] = -1
        h["positions"][start:end] = 0
        h["slot_mapping"][start:end] = -1
        h["seq_lens"][start:end] = 1
        h["block_tables"][start:end] = 0

    def _meta(self, b: int) -> AttentionMetadata:
        d = self.dev
        return AttentionMetadata(slot_mapping=d["slot_mapping"][:b], query_start_loc=self.query_start_loc[: b + 1],
                                 seq_lens=d["seq_lens"][:b], block_tables=d["block_tables"][:b],
                                 max_query_len=1, max_seq_len=self.runner.max_model_len)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        runner = self.runner
        ids, positions, token_src = self.dev["input_ids"], self.dev["positions"], self.dev["token_src"]

        def step(b: int) -> torch.Tensor:
            runner.fill_pending(ids[:b], token_src[:b], runner.sampled)
            hidden = runner.model(ids[:b], positions[:b])
            return runner.model.compute_logits(hidden) if b <= LOGITS_MAX_BATCH else hidden

        for b in reversed(self.buckets):
            meta = self._meta(b)
            with forward_context(meta):
                step(b)  # warm-up: compiles kernels for this shape
                torch.cuda.synchronize()
                graph = self.graphs[b] = torch.cuda.CUDAGraph()  # held before capture, so release() sees it
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[b] = step(b)
            if self.pool is None:
                self.pool = graph.pool()
        torch.cuda.synchronize()

    def release(self) -> None:
        """Drop every graph (and with them their collectives); the runner then runs eagerly."""
        torch.cuda.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def fits(self, batch: "ModelInput") -> bool:
        return (bool(self.graphs) and len(batch.seq_lens) <= self.buckets[-1]
                and batch.block_tables.shape[1] <= self.host["block_tables"].shape[1])

    def replay(self, batch: "ModelInput") -> tuple[torch.Tensor, bool]:
        """The batch's rows of the graph's output (a view, valid until the next replay), and whether they are
        logits (buckets up to LOGITS_MAX_BATCH) rather than hidden states."""
        n = len(batch.seq_lens)
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        w = batch.block_tables.shape[1]
        self.staging.wait_host_free()
        h = self.host
        h["input_ids"][:n] = batch.input_ids
        h["token_src"][:n] = -1 if batch.token_src is None else batch.token_src
        h["positions"][:n] = batch.positions
        h["slot_mapping"][:n] = batch.slot_mapping
        h["seq_lens"][:n] = batch.seq_lens
        h["block_tables"][:n, :w] = batch.block_tables
        h["block_tables"][:n, w:] = 0
        self._pad(n, b)
        self.staging.copy(self.tables_at + b * self.row_bytes)
        self.graphs[b].replay()
        return self.outputs[b][:n], b <= LOGITS_MAX_BATCH
