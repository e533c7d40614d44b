"""The Gluon decode kernel for an e4m3 KV cache against dense float64 attention over the values the cache holds
(skipped without CUDA; CUDA-graph replay: test_triton_kernels.py).

Unused cache slots hold NaN, and outputs start as NaN (nan_filled_allocations): a key read past a context or an
output element never written fails the comparison."""
from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("e4m3 conversions need sm_89 or later", allow_module_level=True)

from paged_cases import PagedCase, as_e4m3, make_case, reference_attention, rel_err  # noqa: E402
from tokenmill.kernels import triton_fp8_decode, triton_ops  # noqa: E402
from tokenmill.kernels.triton_arrive import counters  # noqa: E402

pytestmark = pytest.mark.usefixtures("nan_filled_allocations")

# batch, longest context, block size, query heads, kv heads, head dim, query dtype
CASES = [
    (1, 1, 16, 8, 8, 64, torch.bfloat16),
    (1, 4000, 16, 32, 8, 128, torch.bfloat16),      # one sequence, many partitions
    (3, 700, 32, 32, 4, 128, torch.bfloat16),
    (7, 1500, 16, 16, 16, 64, torch.bfloat16),      # no GQA
    (16, 300, 16, 64, 8, 128, torch.float16),       # GQA 8, fp16 queries
    (33, 513, 32, 28, 4, 128, torch.bfloat16),      # group of 7 heads
    (5, 2500, 64, 8, 1, 64, torch.bfloat16),        # one kv head, blocks of 64
    (9, 37, 16, 12, 4, 128, torch.float16),         # group of 3, contexts shorter than a chunk
    (64, 1100, 16, 32, 8, 128, torch.bfloat16),
    (256, 200, 16, 32, 8, 64, torch.bfloat16),
]


def _fp8_case(batch: int, max_ctx: int, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, seq_lens: list[int] | None = None, table_width: int = 0) -> PagedCase:
    rng = random.Random(batch * max_ctx + head_dim)
    seq_lens = seq_lens or [max_ctx] + [rng.randint(1, max_ctx) for _ in range(batch - 1)]
    return as_e4m3(make_case(seq_lens, [1] * batch, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda",
                             seed=batch + max_ctx, garbage=float("nan"), table_width=table_width))


def _args(case: PagedCase) -> tuple:
    return (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, case.scale, 1)


@pytest.mark.parametrize("batch,max_ctx,block_size,num_heads,num_kv_heads,head_dim,dtype", CASES,
                         ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None)
def test_fp8_decode_matches_reference(batch: int, max_ctx: int, block_size: int, num_heads: int,
                                      num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    case = _fp8_case(batch, max_ctx, block_size, num_heads, num_kv_heads, head_dim, dtype)
    assert triton_fp8_decode.supports(case.q, case.k_cache, case.v_cache)
    out = triton_ops.paged_attention(*_args(case))
    assert out.dtype == dtype and rel_err(out, reference_attention(case)) < 1e-2
    # the partition that finished last merged its sequence's partitions and left the counter at 0 for the next
    assert counters(out.device, batch * num_kv_heads).count_nonzero() == 0


# (min, max partition, programs a multiprocessor, largest target): one trip of the loop a partition; lengths from
# each context over many programs (contexts of 1 to 3,000 tokens: one partition to dozens, a partial last trip);
# a target of 4 (the 3,000-token context still needs 6 of 512); fixed partitions of max_partition (FIXED: target 1)
SPLITS = [(32, 32, 1, 1024), (32, 512, 64, 64), (64, 512, 16, 4), (128, 512, 8, 1), (1024, 1024, 1, 1)]


@pytest.mark.parametrize("min_partition,max_partition,programs_per_sm,max_splits", SPLITS)
def test_fp8_decode_partitions(monkeypatch: pytest.MonkeyPatch, min_partition: int, max_partition: int,
                               programs_per_sm: int, max_splits: int) -> None:
    """Every way of cutting contexts (triton_split.py) gives the reference's answer, through a table as wide as a
    CUDA-graph runner's (the grid covers 4,096 tokens), and the programs that arrive leave every counter at 0."""
    cfg = {"min_partition": min_partition, "max_partition": max_partition, "programs_per_sm": programs_per_sm,
           "max_splits": max_splits}
    for key, value in cfg.items():
        monkeypatch.setitem(triton_fp8_decode.FP8_DECODE_CFG, key, value)
    case = _fp8_case(6, 3000, 16, 32, 8, 128, torch.bfloat16, seq_lens=[1300, 1, 3000, 47, 512, 545],
                     table_width=256)
    out = triton_ops.paged_attention(*_args(case))
    assert rel_err(out, reference_attention(case)) < 1e-2
    assert counters(out.device, 6 * 8).count_nonzero() == 0


def test_unsupported_shapes_fall_back() -> None:
    """Blocks shorter than a chunk, head dims other than 64 and 128 and groups over 8 take the Triton kernel."""
    for shape in [(4, 300, 8, 8, 2, 64), (2, 200, 16, 8, 8, 96), (2, 200, 16, 32, 2, 64)]:
        case = _fp8_case(*shape, torch.bfloat16)
        assert not triton_fp8_decode.supports(case.q, case.k_cache, case.v_cache)
        out = triton_ops.paged_attention(*_args(case))
        assert rel_err(out, reference_attention(case)) < 1e-2


def test_fp8_decode_rescales_when_the_max_jumps() -> None:
    """Even heads' queries x12 put their scores (log2 units) ~17 apart one standard deviation: their running max
    jumps past the lazy-rescaling threshold (8) after the first chunk, odd heads' rarely, so the rescale runs with
    accumulated sums and a different factor for each of a lane's two heads."""
    case = _fp8_case(4, 3000, 16, 16, 2, 128, torch.bfloat16)
    case.q[:, 0::2] *= 12
    out = triton_ops.paged_attention(*_args(case))
    assert rel_err(out, reference_attention(case)) < 1e-2


def test_fp8_decode_empty_and_cut_contexts() -> None:
    """A sequence with no context gets zeros. One longer than its block table holds (a caller's error) is cut to
    the grid's partitions, as in the Triton kernel: table entries past the width read block 0, never memory outside
    the pool, and exactly the programs that arrive leave every partition counter at 0 for the next launch."""
    case = _fp8_case(3, 300, 16, 32, 8, 128, torch.bfloat16, seq_lens=[0, 300, 45])
    out = triton_ops.paged_attention(*_args(case))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out[1:], reference_attention(case)[1:]) < 1e-2
    case.seq_lens[1] = 5000  # the table holds 304 tokens
    triton_ops.paged_attention(*_args(case))
    torch.cuda.synchronize()
    assert counters(out.device, 3 * 8).count_nonzero() == 0
