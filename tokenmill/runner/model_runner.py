"""ModelRunner: owns the model and the KV cache tensors, turns a scheduled step into a flat batch (input
ids, positions, slot mapping, block tables), runs the forward (a CUDA graph for decode steps when one fits),
and samples. With tensor parallelism the host-side batch is what rank 0 sends the other ranks, which replay
the same forward (engine/tp_worker.py)."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.config import EngineArgs, ModelConfig
from tokenmill.core.scheduler import SchedulerOutput
from tokenmill.kernels import get_ops
from tokenmill.distributed import all_reduce_min, broadcast_object, broadcast_tensor, tp_rank, tp_size
from tokenmill.layers.attention import AttentionMetadata, PagedAttention, forward_context
from tokenmill.layers.linear import kv_heads_per_rank
from tokenmill.outputs import Logprob
from tokenmill.quant.kv_cache import kv_cache_torch_dtype, kv_row_width, prepare_fp8_kv
from tokenmill.request import Request
from tokenmill.runner.cuda_graph import CUDAGraphRunner
from tokenmill.runner.sampler import Sampler, SamplerOutput
from tokenmill.runner.staging import StagingBuffer
from tokenmill.spec.rejection_sampler import RejectionSampler, VerifyOutput

DEFAULT_CPU_KV_BYTES = 512 << 20


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of every layer for one token on this rank, in the cache's dtype (int8 rows carry their scales)."""
    row = kv_row_width(config.head_dim, dtype) * dtype.itemsize
    return 2 * config.num_hidden_layers * kv_heads_per_rank(config.num_key_value_heads) * row


def kv_cache_zeros(lead: tuple[int, ...], num_blocks: int, block_size: int, num_kv_heads: int, width: int,
                   dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache indexed [*lead, block, token, KV head, row] as every kernel and twin takes it (by strides),
    stored head-major, [*lead, block, KV head, token, row]: the tokens of one (block, KV head) are one contiguous
    run (2 KB for 16 e4m3 rows of 128), which the decode program of that KV head reads whole. H200, e4m3 decode
    attention on the offline workload's batches: 4% faster than token-major storage (docs/BENCHMARKS.md)."""
    storage = torch.zeros(*lead, num_blocks, num_kv_heads, block_size, width, dtype=dtype, device=device)
    return storage.transpose(-3, -2)


@dataclass
class LaunchedStep:
    """A step whose sampled tokens are still on the device (async scheduling reads them back a step later).
    Their copy to the host is queued right after sampling, before the next step's kernels, so reading them
    back waits for this step only."""

    reqs: list[Request]                 # the sampled requests, in row order; their tokens are the first rows
                                        # of the runner's `sampled` buffer until the next launch
    host_tokens: torch.Tensor           # their copy on the host (pinned on CUDA), valid once `ready`
    ready: torch.cuda.Event | None      # recorded after the copy (None on the CPU: already there)


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
    # async scheduling: for each input row, the row of the previous step's sampled tokens (still on the
    # device) that replaces its placeholder id, or -1; None if no row takes one. shares_sampled: under tensor
    # parallelism rank 0 broadcasts this step's sampled tokens into every rank's `sampled` buffer
    token_src: np.ndarray | None = None
    shares_sampled: bool = False
    # SamplingParams.prompt_logprobs: the rows whose logits give a prompt token's logprob, that token (the next
    # prompt token), and the most alternatives any of them asks for; None when no request of the step asks
    logprob_rows: np.ndarray | None = None
    logprob_targets: np.ndarray | None = None
    logprob_k: int = 0


@dataclass
class PromptLogprobTensors:
    """The prompt logprobs of a step's logprob rows, on the host: each row's target token's logprob and rank,
    and its best logprob_k tokens."""

    logprobs: torch.Tensor  # [rows] float32
    ranks: torch.Tensor     # [rows] int64
    top_ids: torch.Tensor   # [rows, logprob_k] int64
    top_logprobs: torch.Tensor  # [rows, logprob_k] float32


def prompt_logprob_spans(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    """(index in out.scheduled, lo, hi) for each scheduled request owing prompt logprobs: positions [lo, hi) of
    its prompt are computed this step and their logits give prompt tokens lo + 1 to hi."""
    spans = []
    for i, s in enumerate(out.scheduled):
        r = s.request
        owed = r.prompt_logprobs_from
        if owed is None:
            continue
        c = r.num_computed_tokens
        lo, hi = max(c, owed), min(c + s.num_new_tokens - s.num_spec_tokens, r.num_prompt_tokens - 1)
        if lo < hi:
            spans.append((i, lo, hi))
    return spans


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
        if device.type == "cuda":
            self._compile_prefill_tiles()
        self.sampler = Sampler(model_config.vocab_size, eos_token_ids, device, args.seed)
        if device.type == "cuda":
            self._compile_sampler()
        self.rejection_sampler = RejectionSampler(self.sampler) if args.speculative else None
        self.staging = StagingBuffer(device) if device.type == "cuda" else None
        self.fill_pending = get_ops(device).fill_pending
        # async scheduling samples into this fixed buffer, so a decode graph can read the tokens it feeds back
        self.sampled = torch.zeros(args.max_num_seqs, dtype=torch.long, device=device)
        self.graphs: CUDAGraphRunner | None = None
        if device.type == "cuda" and not args.enforce_eager:
            self.graphs = CUDAGraphRunner(self, args.max_num_seqs)

    def recapture_graphs(self) -> None:
        """Capture the decode graphs again, after the model's code has changed (`bench parts` skips parts of it);
        eager runners have none."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = CUDAGraphRunner(self, self.args.max_num_seqs)

    # ---- memory -----------------------------------------------------------------------------
    def _num_blocks(self) -> int:
        per_block = (kv_bytes_per_token(self.config, self.kv_dtype) + self.extra_kv_bytes_per_token) * self.block_size
        if self.args.num_gpu_blocks_override:
            return self.args.num_gpu_blocks_override
        if self.args.kv_cache_tokens is not None:
            return 1 + -(-self.args.kv_cache_tokens // self.block_size)  # the null block is not for tokens
        if self.args.kv_cache_memory is not None:
            budget = self.args.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._profile_free_memory()
        else:
            budget = DEFAULT_CPU_KV_BYTES
        # never more than max_num_seqs requests at full context can hold: a small model on a large GPU would
        # otherwise get tens of millions of blocks (and as many Python objects in the block pool)
        num_blocks = min(int(budget // per_block), 1 + self.args.max_num_seqs * self.max_blocks_per_seq)
        if num_blocks < 2:
            raise ValueError(f"the KV budget of {budget} bytes holds {num_blocks} blocks of {per_block} bytes; "
                             "at least 2 are needed")
        return num_blocks

    @torch.inference_mode()
    def _profile_free_memory(self) -> int:
        """Run the worst-case prefill batch once, then give the KV pool what utilization leaves."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for m in self.model.modules():
            if isinstance(m, PagedAttention):
                width = kv_row_width(m.head_dim, self.kv_dtype)
                m.k_cache, m.v_cache = kv_cache_zeros((2,), 2, self.block_size, m.num_kv_heads, width,
                                                      self.kv_dtype, self.device)
        self._placeholder_prefill(self.worst_case_prefill(), logits=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        in_use_by_others = total - free - torch.cuda.memory_reserved()
        return int(total * self.args.gpu_memory_utilization - peak - max(in_use_by_others, 0))

    def worst_case_prefill(self) -> list[int]:
        """The prompt lengths of the largest step the scheduler can form: the whole token budget (at most
        max_num_seqs requests of max_model_len tokens) in prompts of max_model_len tokens. A budget beyond one
        context (vLLM's offline 16384 over an 8192-token model) has several prompts a step, and their
        activations are what the profile must see: profiled as one prompt of max_model_len tokens, a
        131072-token budget ran out of memory in its first step (docs/BENCHMARKS.md)."""
        tokens = min(self.args.max_num_batched_tokens, self.args.max_num_seqs * self.max_model_len)
        full, rest = divmod(tokens, self.max_model_len)
        return [self.max_model_len] * full + ([rest] if rest else [])

    def _max_prefill(self) -> int:
        return min(self.args.max_num_batched_tokens, self.max_model_len)

    def _placeholder_prefill(self, prompt_lens: list[int], logits: bool = False) -> None:
        """Prompts of these lengths through the model as one step of placeholder tokens (slot -1: nothing is
        written to the cache); logits: also the LM head over as many rows as a step can sample, their float32
        log-softmax and its comparison with one column (prompt logprobs take both, for ranks, over that many rows
        at a time)."""
        n = sum(prompt_lens)
        lens = torch.tensor(prompt_lens, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=self.device),
            query_start_loc=torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0)).to(self.device),
            seq_lens=lens.to(self.device),
            block_tables=torch.zeros(len(prompt_lens), math.ceil(max(prompt_lens) / self.block_size),
                                     dtype=torch.int32, device=self.device),
            max_query_len=max(prompt_lens), max_seq_len=max(prompt_lens))
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(length) for length in prompt_lens]).to(self.device)
        with forward_context(meta):
            hidden = self.model(ids, positions)
            if logits:
                rows = self.model.compute_logits(hidden[-min(n, self.args.max_num_seqs):])
                lp = torch.log_softmax(rows, dim=-1, dtype=torch.float32)
                (lp > lp[:, :1]).sum(-1)

    @torch.inference_mode()
    def _compile_prefill_tiles(self) -> None:
        """Placeholder prefills for every query tile of prefill attention (it shrinks the tile to a batch's longest
        query), each at a multiple of 16 tokens and one below (Triton also specializes integer arguments, such
        as the quantized matmul's row count, on divisibility by 16), so that no first compilation, a second or
        more, stalls serving."""
        from tokenmill.kernels.triton_attention import PREFILL_QUERY_TILES
        tiles = {min(tile, self._max_prefill()) for tile in PREFILL_QUERY_TILES}
        for n in sorted({length for tile in tiles for length in (tile, tile - 1) if length > 1}):
            self._placeholder_prefill([n])

    @torch.inference_mode()
    def _compile_sampler(self) -> None:
        """The sampling kernels once, on logits of the LM head's shape, so that their first compilation (a
        fraction of a second) does not stall the first request that samples."""
        hidden = torch.zeros(1, self.config.hidden_size, dtype=self.dtype, device=self.device)
        self.sampler.compile(self.model.compute_logits(hidden))

    def _allocate_kv_cache(self) -> None:
        """A pool larger than the memory left is the caller's ValueError naming its size and the options that set
        it (it was the allocator's RuntimeError, "DefaultCPUAllocator: can't allocate memory")."""
        c = self.config
        try:
            self.kv_cache = kv_cache_zeros(
                (2, c.num_hidden_layers), self.num_blocks, self.block_size, kv_heads_per_rank(c.num_key_value_heads),
                kv_row_width(c.head_dim, self.kv_dtype), self.kv_dtype, self.device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
                raise
            size = self.num_blocks * self.block_size * kv_bytes_per_token(c, self.kv_dtype)
            raise ValueError(f"the KV cache of {self.num_blocks} blocks ({size / 2**30:.1f} GiB) does not fit in the "
                             f"{self.device.type} memory left; lower kv_cache_memory, kv_cache_tokens or "
                             "num_gpu_blocks_override") from None
        layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        for i, m in enumerate(layers):
            m.k_cache, m.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    # ---- one step ---------------------------------------------------------------------------
    def prepare_input(self, out: SchedulerOutput, block_ids: list[list[int]],
                      prompt_logprobs: bool = False) -> ModelInput:
        """The flat batch of a step; sample_rows are the rows whose logits are sampled (with draft tokens: the
        last row and every draft row); prompt_logprobs: also the rows of prompt logprobs owed (a draft model's
        runner leaves them to the target's). Per request only the token ids are gathered in Python; positions,
        slots and tables are built for the whole batch at once, since at a few hundred requests per step this is
        host time the device waits for."""
        sched = out.scheduled
        n = len(sched)
        ids: list[int] = []
        for s in sched:
            r = s.request
            ids += r.all_token_ids[r.num_computed_tokens: r.num_computed_tokens + s.num_new_tokens]
            if s.num_spec_tokens:
                ids += r.spec_token_ids
        starts = np.fromiter((s.request.num_computed_tokens for s in sched), np.int64, n)
        num_new = np.fromiter((s.num_new_tokens for s in sched), np.int64, n)
        num_spec = np.fromiter((s.num_spec_tokens for s in sched), np.int64, n)
        samples = np.fromiter((s.samples for s in sched), np.bool_, n)
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_new, out=qsl[1:])
        total = int(qsl[-1])
        positions = np.repeat(starts - qsl[:-1], num_new) + np.arange(total)
        lens = np.fromiter(map(len, block_ids), np.int64, n)
        tables = np.zeros((n, int(lens.max())), dtype=np.int32)
        tables[np.arange(tables.shape[1]) < lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(block_ids), np.int32, int(lens.sum()))
        bs = self.block_size
        slots = tables[np.repeat(np.arange(n), num_new), positions // bs].astype(np.int64) * bs + positions % bs
        counts = np.where(samples, num_spec + 1, 0)
        first = np.repeat(qsl[1:] - 1 - num_spec, counts)
        sample_rows = first + np.arange(len(first)) - np.repeat(np.cumsum(counts) - counts, counts)
        seq_lens = (starts + num_new).astype(np.int32)
        batch = ModelInput(
            input_ids=np.asarray(ids, dtype=np.int64), positions=positions, slot_mapping=slots,
            query_start_loc=qsl.astype(np.int32), seq_lens=seq_lens, block_tables=tables, sample_rows=sample_rows,
            max_query_len=int(num_new.max()), max_seq_len=int(seq_lens.max()))
        spans = prompt_logprob_spans(out) if prompt_logprobs else []
        if spans:
            batch.logprob_rows = np.concatenate([np.arange(lo, hi) + (qsl[i] - starts[i]) for i, lo, hi in spans])
            batch.logprob_targets = np.asarray([t for i, lo, hi in spans
                                                for t in sched[i].request.prompt_token_ids[lo + 1: hi + 1]], np.int64)
            batch.logprob_k = max(sched[i].request.sampling_params.prompt_logprobs for i, _, _ in spans)
        return batch

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_ids: list[list[int]]) -> SamplerOutput | VerifyOutput:
        """One step: sampled tokens, or, when some request carries draft tokens, the verified ones; and the
        prompt logprobs the step computed."""
        logits, prompt = self.forward_all_ranks(self._batch(out, block_ids, prompt_logprobs=True))
        reqs = [s.request for s in out.scheduled if s.samples]
        if logits is None:
            result: SamplerOutput | VerifyOutput = SamplerOutput([], [])
        elif self.rejection_sampler is not None and any(s.num_spec_tokens for s in out.scheduled):
            result = self.rejection_sampler(logits, reqs)
        else:
            result = self.sampler(logits, reqs)
        if prompt is not None:
            result.prompt_logprobs = assemble_prompt_logprobs(out, prompt)
        return result

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, block_ids: list[list[int]], prev: LaunchedStep | None) -> LaunchedStep:
        """Forward and sample one step without reading the tokens back (async scheduling). Tokens of `prev` that
        the host has not seen yet are fed to this step's input on the device."""
        logits = self.compute_logits(out, block_ids, prev, shares_sampled=True)
        reqs = [s.request for s in out.scheduled if s.samples]
        tokens = None
        try:
            tokens = self.sampled[:0] if logits is None else \
                self.sampler.sample(logits, reqs, out=self.sampled[:len(reqs)])[0]
        finally:  # the other ranks wait for this step's tokens (to feed the next step's input): even if sampling
            if self.tp_size > 1 and len(reqs):  # failed here, so that the group's collectives stay in step
                broadcast_tensor(torch.zeros(len(reqs), dtype=torch.long, device=self.device) if tokens is None
                                 else tokens)
        if self.device.type != "cuda":
            return LaunchedStep(reqs, tokens.clone(), None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedStep(reqs, host, ready)

    def read_back(self, step: LaunchedStep) -> list[int]:
        """A launched step's tokens on the host (waits for that step, not for any launched after it)."""
        if step.ready is not None:
            step.ready.synchronize()
        return step.host_tokens.tolist()

    @torch.inference_mode()
    def compute_logits(self, out: SchedulerOutput, block_ids: list[list[int]], prev: LaunchedStep | None = None,
                       shares_sampled: bool = False) -> torch.Tensor | None:
        """Forward one step; the logits of the rows to sample, None if there are none. shares_sampled: the caller
        broadcasts the tokens it samples from them to the other tensor-parallel ranks (async scheduling)."""
        return self.forward_all_ranks(self._batch(out, block_ids, prev, shares_sampled))[0]

    def _batch(self, out: SchedulerOutput, block_ids: list[list[int]], prev: LaunchedStep | None = None,
               shares_sampled: bool = False, prompt_logprobs: bool = False) -> ModelInput:
        if tp_size() != self.tp_size:
            raise RuntimeError(f"this runner was built for {self.tp_size} tensor-parallel rank(s) but the process now "
                               f"runs a group of {tp_size()}: one engine at a time when tensor parallelism is on")
        batch = self.prepare_input(out, block_ids, prompt_logprobs)
        if prev is not None:
            batch.token_src = pending_inputs(out, batch, prev)
        batch.shares_sampled = shares_sampled
        return batch

    def forward_all_ranks(self, batch: ModelInput) -> tuple[torch.Tensor | None, PromptLogprobTensors | None]:
        """forward() here, and on every other tensor-parallel rank (engine/tp_worker.py replays the batch)."""
        if self.tp_size > 1:
            broadcast_object(batch)
        return self.forward(batch)

    @torch.inference_mode()
    def forward(self, batch: ModelInput) -> tuple[torch.Tensor | None, PromptLogprobTensors | None]:
        """The forward of one flat batch: logits of its sample rows (None if there are none), and the prompt
        logprobs of its logprob rows (None if there are none, and on tensor-parallel ranks other than 0, which
        take part only in the LM head's gather of its vocabulary shards)."""
        num_seqs = len(batch.seq_lens)
        scored: list[torch.Tensor] = []  # the logprob rows and their targets on the device
        if (self.graphs is not None and batch.max_query_len == 1 and batch.logprob_rows is None
                and self.graphs.fits(batch)):
            out, is_logits = self.graphs.replay(batch)
            sample_rows = None if len(batch.sample_rows) == num_seqs else self._to_device([batch.sample_rows])[0]
            if is_logits and len(batch.sample_rows):
                return (out if sample_rows is None else out[sample_rows]), None
            hidden = out
        else:
            pending = [] if batch.token_src is None else [batch.token_src]
            wanted = [] if batch.logprob_rows is None else [batch.logprob_rows, batch.logprob_targets]
            ids, positions, slots, qsl, seq_lens, tables, sample_rows, *rest = self._to_device([
                batch.input_ids, batch.positions, batch.slot_mapping, batch.query_start_loc, batch.seq_lens,
                batch.block_tables, batch.sample_rows, *wanted, *pending])  # one copy: a second would overwrite
            scored, token_src = rest[:len(wanted)], rest[len(wanted):]
            if token_src:
                self.fill_pending(ids, token_src[0], self.sampled)
            meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables,
                                     max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len)
            with forward_context(meta):
                hidden = self.model(ids, positions)
        prompt = self._prompt_logprobs(hidden, *scored, batch.logprob_k) if scored else None
        if not len(batch.sample_rows):
            return None, prompt
        return self.model.compute_logits(hidden if sample_rows is None else hidden[sample_rows]), prompt

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                         k: int) -> PromptLogprobTensors | None:
        """The raw log-softmax (vLLM's default logprobs mode) at the logprob rows, max_num_seqs rows at a time:
        the memory profile reserved logits for that many rows, and a prompt's rows may be thousands. Other
        tensor-parallel ranks than 0 only take part in the LM head's gather (None): rank 0 alone reports."""
        parts = []
        chunk, reports = self.args.max_num_seqs, tp_rank() == 0
        for start in range(0, len(rows), chunk):
            logits = self.model.compute_logits(hidden[rows[start:start + chunk]])[:, :self.config.vocab_size]
            if not reports:
                continue
            lp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            target = lp.gather(1, targets[start:start + chunk, None])
            top = lp.topk(k, dim=-1)
            parts.append((target[:, 0], (lp > target).sum(-1) + 1, top.indices, top.values))
        return PromptLogprobTensors(*(torch.cat(t).cpu() for t in zip(*parts))) if parts else None

    def _to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """On the CPU the arrays themselves; on a GPU, one copy through the staging buffer."""
        if self.staging is None:
            return [torch.from_numpy(a) for a in arrays]
        return self.staging.to_device(arrays)


def assemble_prompt_logprobs(out: SchedulerOutput, t: PromptLogprobTensors) -> list[tuple[Request, list[Logprob]]]:
    """Per request owing prompt logprobs this step, its next ones (prompt_logprob_spans' order, as the rows)."""
    logprobs, ranks, top_ids, top_lps = (x.tolist() for x in (t.logprobs, t.ranks, t.top_ids, t.top_logprobs))
    result, row = [], 0
    for i, lo, hi in prompt_logprob_spans(out):
        r = out.scheduled[i].request
        k = r.sampling_params.prompt_logprobs
        lps = []
        for target in r.prompt_token_ids[lo + 1: hi + 1]:
            lps.append(Logprob(target, logprobs[row], dict(zip(top_ids[row][:k], top_lps[row][:k])), ranks[row]))
            row += 1
        result.append((r, lps))
    return result


def pending_inputs(out: SchedulerOutput, batch: ModelInput, prev: LaunchedStep) -> np.ndarray | None:
    """ModelInput.token_src: the input rows of this step that hold a token `prev` sampled and the host has not
    read yet, each with the row of `prev`'s tokens it takes."""
    row_of = {id(r): i for i, r in enumerate(prev.reqs)}
    token_src = None
    for i, s in enumerate(out.scheduled):
        r = s.request
        offset = r.num_tokens - 1 - r.num_computed_tokens  # the pending token is always the last one
        if r.has_pending_token and 0 <= offset < s.num_new_tokens - s.num_spec_tokens:
            if token_src is None:
                token_src = np.full(len(batch.input_ids), -1, dtype=np.int64)
            token_src[int(batch.query_start_loc[i]) + offset] = row_of[id(r)]
    return token_src
