"""The Gluon decode kernel for an e4m3 KV cache against dense float64 attention over the values the cache holds
(skipped without CUDA).

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

from paged_cases import make_case, reference_attention, rel_err  # noqa: E402
from tokenmill.kernels import triton_fp8_decode, triton_ops  # noqa: E402
from tokenmill.kernels.triton_arrive import counters  # noqa: E402

pytestmark = pytest.mark.usefixtures("nan_filled_allocations")
FP8 = torch.float8_e4m3fn

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
              dtype: torch.dtype, table_width: int = 0, garbage: float = float("nan")):
    rng = random.Random(batch * max_ctx + head_dim)
    seq_lens = [max_ctx] + [rng.randint(1, max_ctx) for _ in range(batch - 1)]
    case = make_case(seq_lens, [1] * batch, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda",
                     seed=batch + max_ctx, garbage=garbage, table_width=table_width)
    case.k_cache, case.v_cache = case.k_cache.to(FP8), case.v_cache.to(FP8)
    case.keys = [k.to(FP8).double() for k in case.keys]  # the dense float64 answer of what the cache holds
    case.values = [v.to(FP8).double() for v in case.values]
    return case


def _args(case) -> tuple:
    return (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, case.scale, 1)


@pytest.mark.parametrize("batch,max_ctx,block_size,num_heads,num_kv_heads,head_dim,dtype", CASES,
                         ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None)
def test_fp8_decode_matches_reference(batch: int, max_ctx: int, block_size: int, num_heads: int, num_kv_heads: int,
                                 head_dim: int, dtype: torch.dtype) -> None:
    case = _fp8_case(batch, max_ctx, block_size, num_heads, num_kv_heads, head_dim, dtype)
    assert triton_fp8_decode.supports(case.q, case.k_cache)
    out = triton_ops.paged_attention(*_args(case))
    assert out.dtype == dtype and rel_err(out, reference_attention(case)) < 1e-2
    # the partition that finished last merged its sequence's partitions and left the counter at 0 for the next
    assert counters(out.device, batch * num_kv_heads).count_nonzero() == 0


@pytest.mark.parametrize("partition", [16, 48, 128, 1024])  # one chunk, an odd number of chunks, more
def test_fp8_decode_partitions(monkeypatch: pytest.MonkeyPatch, partition: int) -> None:
    """Every partition length gives the reference's answer."""
    monkeypatch.setitem(triton_fp8_decode.FP8_DECODE_CFG, "partition", partition)
    monkeypatch.setitem(triton_fp8_decode.FP8_DECODE_CFG, "min_partition", partition)
    case = _fp8_case(6, 1300, 16, 32, 8, 128, torch.bfloat16)
    out = triton_ops.paged_attention(*_args(case))
    assert rel_err(out, reference_attention(case)) < 1e-2


def test_unsupported_shapes_fall_back() -> None:
    """Blocks shorter than a chunk, head dims other than 64 and 128 and groups over 8 take the Triton kernel."""
    for shape in [(4, 300, 8, 8, 2, 64), (2, 200, 16, 8, 8, 96), (2, 200, 16, 32, 2, 64)]:
        case = _fp8_case(*shape, torch.bfloat16)
        assert not triton_fp8_decode.supports(case.q, case.k_cache)
        out = triton_ops.paged_attention(*_args(case))
        assert rel_err(out, reference_attention(case)) < 1e-2


@pytest.mark.parametrize("table_width", [4, 80])  # one partition, several partitions
def test_fp8_decode_cuda_graph_replay_matches_eager(table_width: int) -> None:
    # finite garbage: contexts grown after capture read slots the case never wrote, the same way in both runs
    case = _fp8_case(3, 60, 16, 32, 8, 128, torch.bfloat16, table_width=table_width, garbage=30.0)
    args = _args(case)
    triton_ops.paged_attention(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_ops.paged_attention(*args)
    longer = [[1200, 300, 17], [1280, 513, 256]] if table_width > 4 else []  # partitions merged in the graph
    for seq_lens in [[60, 33, 17], [5, 64, 1], *longer]:
        case.seq_lens.copy_(torch.tensor(seq_lens))
        case.q.copy_(torch.randn_like(case.q))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, triton_ops.paged_attention(*args))
    assert counters(out.device, 3 * 8).count_nonzero() == 0
