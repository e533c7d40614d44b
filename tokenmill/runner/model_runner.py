"""ModelRunner: owns the model and the KV cache tensors, turns a scheduled step into a flat batch (input
ids, positions, slot mapping, block tables), runs the forward (a CUDA graph for decode steps when one fits),
and samples. With tensor parallelism the host-side batch is what rank 0 sends the other ranks, which replay
the same forward (engine/tp_worker.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.config import EngineArgs, ModelConfig
from tokenmill.core.scheduler import SchedulerOutput
from tokenmill.distributed import all_reduce_min, broadcast_object, tp_size
from tokenmill.layers.attention import AttentionMetadata, PagedAttention, forward_context
from tokenmill.layers.linear import kv_heads_per_rank
from tokenmill.quant.kv_cache import kv_cache_torch_dtype, kv_row_width, prepare_fp8_kv
from tokenmill.runner.cuda_graph import CUDAGraphRunner
from tokenmill.runner.sampler import Sampler, SamplerOutput
from tokenmill.spec.rejection_sampler import RejectionSampler, VerifyOutput

DEFAULT_CPU_KV_BYTES = 512 << 20


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of every layer for one token on this rank, in the cache's dtype (int8 rows carry their scales)."""
    row = kv_row_width(config.head_dim, dtype) * dtype.itemsize
    return 2 * config.num_hidden_layers * kv_heads_per_rank(config.num_key_value_heads) * row


@dataclass
class ModelInput:
    """One step's flat batch on the host: small, picklable, and all any rank needs to run the forward."""

    input_ids: np.ndarray        # [num_tokens] int64
    positions: np.ndarray        # [num_tokens] int64
    slot_mapping: np.ndarray     # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray         # [num_seqs] int32
    block_tables: np.ndarray     # [num_seqs, max_blocks] int32
    sample_rows: np.ndarray      # rows whose logits are sampled, int64
    max_query_len: int
    max_seq_len: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, args: EngineArgs, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, eos_token_ids: list[int],
                 extra_kv_bytes_per_token: int = 0) -> None:
        """extra_kv_bytes_per_token: K/V a draft model keeps per token in blocks of the same ids; the pool is
        sized so that both fit the memory budget."""
        self.model, self.config, self.args = model, model_config, args
        self.extra_kv_bytes_per_token = extra_kv_bytes_per_token
        self.device, self.dtype = device, dtype
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)
        self.kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, dtype)
        if self.kv_dtype == torch.float8_e4m3fn:
            prepare_fp8_kv(model, device, dtype, model_config.vocab_size)
        self.tp_size = tp_size()
        self.num_blocks = all_reduce_min(self._num_blocks())  # every rank's cache holds the same block ids
        self._allocate_kv_cache()
        self.sampler = Sampler(model_config.vocab_size, eos_token_ids, device, args.seed)
        self.rejection_sampler = RejectionSampler(self.sampler) if args.speculative else None
        self.graphs: CUDAGraphRunner | None = None
        if device.type == "cuda" and not args.enforce_eager:
            self.graphs = CUDAGraphRunner(self, args.max_num_seqs)

    # ---- memory -----------------------------------------------------------------------------
    def _num_blocks(self) -> int:
        per_block = (kv_bytes_per_token(self.config, self.kv_dtype) + self.extra_kv_bytes_per_token) * self.block_size
        if self.args.num_gpu_blocks_override:
            return self.args.num_gpu_blocks_override
        if self.args.kv_cache_memory is not None:
            budget = self.args.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._profile_free_memory()
        else:
            budget = DEFAULT_CPU_KV_BYTES
        num_blocks = int(budget // per_block)
        if num_blocks < 2:
            raise ValueError(f"the KV budget of {budget} bytes holds {num_blocks} blocks of {per_block} bytes; "
                             "at least 2 are needed")
        return num_blocks

    @torch.inference_mode()
    def _profile_free_memory(self) -> int:
        """Run the worst-case prefill batch once, then give the KV pool what utilization leaves."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        n = min(self.args.max_num_batched_tokens, self.max_model_len)
        for m in self.model.modules():
            if isinstance(m, PagedAttention):
                width = kv_row_width(m.head_dim, self.kv_dtype)
                m.k_cache = torch.zeros(2, self.block_size, m.num_kv_heads, width, dtype=self.kv_dtype,
                                        device=self.device)
                m.v_cache = torch.zeros_like(m.k_cache)
        meta = AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(1, math.ceil(n / self.block_size), dtype=torch.int32, device=self.device),
            max_query_len=n, max_seq_len=n)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        with forward_context(meta):
            hidden = self.model(ids, torch.arange(n, device=self.device))
            self.model.compute_logits(hidden[-min(n, self.args.max_num_seqs):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        in_use_by_others = total - free - torch.cuda.memory_reserved()
        return int(total * self.args.gpu_memory_utilization - peak - max(in_use_by_others, 0))

    def _allocate_kv_cache(self) -> None:
        c = self.config
        shape = (2, c.num_hidden_layers, self.num_blocks, self.block_size, kv_heads_per_rank(c.num_key_value_heads),
                 kv_row_width(c.head_dim, self.kv_dtype))
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        for i, m in enumerate(layers):
            m.k_cache, m.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    # ---- one step ---------------------------------------------------------------------------
    def prepare_input(self, out: SchedulerOutput, block_ids: list[list[int]]) -> ModelInput:
        """The flat batch of a step; sample_rows are the rows whose logits are sampled (with draft tokens: the
        last row and every draft row)."""
        bs = self.block_size
        ids, pos, slots, qsl, seq_lens, sample_rows = [], [], [], [0], [], []
        for s, blocks in zip(out.scheduled, block_ids):
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            ids.extend(r.all_token_ids[start:end])
            if s.num_spec_tokens:
                ids.extend(r.spec_token_ids)
            p = np.arange(start, end)
            pos.append(p)
            slots.append(np.asarray(blocks, dtype=np.int64)[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + s.num_new_tokens)
            seq_lens.append(end)
            if s.samples:
                sample_rows.extend(range(qsl[-1] - 1 - s.num_spec_tokens, qsl[-1]))
        max_blocks = max(len(b) for b in block_ids)
        tables = np.zeros((len(block_ids), max_blocks), dtype=np.int32)
        for i, b in enumerate(block_ids):
            tables[i, : len(b)] = b
        return ModelInput(
            input_ids=np.asarray(ids, dtype=np.int64), positions=np.concatenate(pos),
            slot_mapping=np.concatenate(slots), query_start_loc=np.asarray(qsl, dtype=np.int32),
            seq_lens=np.asarray(seq_lens, dtype=np.int32), block_tables=tables,
            sample_rows=np.asarray(sample_rows, dtype=np.int64),
            max_query_len=max(s.num_new_tokens for s in out.scheduled), max_seq_len=max(seq_lens))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_ids: list[list[int]]) -> SamplerOutput | VerifyOutput:
        """One step: sampled tokens, or, when some request carries draft tokens, the verified ones."""
        logits = self.compute_logits(out, block_ids)
        reqs = [s.request for s in out.scheduled if s.samples]
        if logits is None:
            return SamplerOutput([], [])
        if self.rejection_sampler is not None and any(s.num_spec_tokens for s in out.scheduled):
            return self.rejection_sampler(logits, reqs)
        return self.sampler(logits, reqs)

    @torch.inference_mode()
    def compute_logits(self, out: SchedulerOutput, block_ids: list[list[int]]) -> torch.Tensor | None:
        """Forward one step; the logits of the rows to sample, None if there are none."""
        if tp_size() != self.tp_size:
            raise RuntimeError(f"this runner was built for {self.tp_size} tensor-parallel rank(s) but the process now "
                               f"runs a group of {tp_size()}: one engine at a time when tensor parallelism is on")
        batch = self.prepare_input(out, block_ids)
        if self.tp_size > 1:
            broadcast_object(batch)  # the other ranks run this same forward (engine/tp_worker.py)
        return self.forward(batch)

    @torch.inference_mode()
    def forward(self, batch: ModelInput) -> torch.Tensor | None:
        """The forward of one flat batch; logits of its sample rows, None if there are none."""
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(batch.slot_mapping).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(batch.query_start_loc).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(batch.seq_lens).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(batch.block_tables).to(dev, non_blocking=True),
            max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len)
        input_ids = torch.from_numpy(batch.input_ids).to(dev, non_blocking=True)
        positions = torch.from_numpy(batch.positions).to(dev, non_blocking=True)
        num_seqs = len(batch.seq_lens)
        if self.graphs is not None and meta.max_query_len == 1 and self.graphs.fits(num_seqs, meta):
            hidden = self.graphs.replay(input_ids, positions, meta)[:num_seqs]
        else:
            with forward_context(meta):
                hidden = self.model(input_ids, positions)
        if not len(batch.sample_rows):
            return None
        return self.model.compute_logits(hidden[torch.from_numpy(batch.sample_rows).to(dev, non_blocking=True)])
