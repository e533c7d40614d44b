"""Each Triton op against a float64 reference on fresh random inputs (skipped without CUDA).

Outputs come from torch.empty, which deterministic mode fills with NaN here, and unused cache slots hold
NaN, so an element the kernel never writes, or a slot it reads by mistake, fails the comparison.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA", allow_module_level=True)
pytest.importorskip("triton")

from paged_cases import as_e4m3, make_case, reference_attention, rel_err  # noqa: E402
from tokenmill.kernels import OP_NAMES, get_ops, torch_ref, triton_attention, triton_ops  # noqa: E402
from tokenmill.kernels.triton_arrive import counters

# torch.empty returns NaN-filled memory: an output element a kernel never writes fails the comparison
pytestmark = pytest.mark.usefixtures("nan_filled_allocations")
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
F32, BF16 = torch.float32, torch.bfloat16


def _ids(value: object) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def _attend(case) -> torch.Tensor:
    return triton_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                                      case.block_tables, case.scale, case.max_query_len)


def test_get_ops_picks_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_KERNELS", raising=False)
    ops = get_ops("cuda")
    assert all(getattr(ops, name) is getattr(triton_ops, name) for name in OP_NAMES)


# batch, longest context, block size, query heads, kv heads, head dim, dtype
DECODE = [
    (1, 1, 16, 8, 8, 64, BF16),
    (1, 4000, 16, 32, 8, 128, BF16),       # one sequence, many partitions
    (3, 700, 32, 32, 4, 128, F32),
    (7, 1500, 16, 16, 16, 64, BF16),       # no GQA
    (16, 300, 8, 64, 8, 128, BF16),        # GQA 8
    (33, 513, 32, 28, 4, 128, F32),        # group of 7 heads
    (64, 1100, 16, 32, 8, 128, BF16),
    (4, 300, 1, 8, 2, 64, F32),            # block size 1
    (5, 2500, 64, 8, 1, 64, BF16),         # one kv head
    (256, 200, 16, 32, 8, 64, BF16),
    (256, 100, 32, 32, 8, 128, F32),
    (2, 200, 16, 8, 8, 96, F32),           # head dim that is not a power of two
]


@pytest.mark.parametrize("batch,max_ctx,block_size,num_heads,num_kv_heads,head_dim,dtype", DECODE, ids=_ids)
def test_decode(batch: int, max_ctx: int, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> None:
    rng = random.Random(batch * max_ctx)
    seq_lens = [max_ctx] + [rng.randint(1, max_ctx) for _ in range(batch - 1)]
    case = make_case(seq_lens, [1] * batch, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda",
                     seed=batch + max_ctx, garbage=float("nan"))
    out = _attend(case)
    assert out.dtype == dtype and rel_err(out, reference_attention(case)) < TOL[dtype]
    # the partition that finished last merged its sequence's partitions and left the counter at 0 for the next
    assert counters(out.device, batch * num_kv_heads).count_nonzero() == 0


# (seq_lens, query_lens) or a batch size drawn at random, block size, query heads, kv heads, head dim, dtype
PREFILL = [
    (([300], [300]), 16, 8, 8, 64, BF16),                                 # one fresh prompt
    (([1000, 37, 515], [1000, 37, 515]), 16, 32, 8, 128, BF16),           # fresh prompts, varlen
    (([700, 129, 64, 2000], [200, 1, 64, 77]), 32, 32, 4, 128, BF16),     # chunks after prefixes, a decode row
    (([513, 90], [250, 90]), 16, 16, 16, 64, F32),
    (([45, 3, 260], [20, 3, 0]), 8, 28, 4, 128, F32),                     # a sequence with no query tokens
    (([4000], [17]), 16, 8, 1, 128, BF16),                                # long prefix, short chunk
    (([2048], [2048]), 16, 32, 8, 128, BF16),
    (([150, 70], [20, 70]), 1, 8, 2, 64, F32),                            # block size 1
    (([333, 40], [333, 33]), 16, 8, 8, 96, F32),
    (64, 16, 32, 8, 128, BF16),
    (200, 32, 16, 2, 64, BF16),
]


@pytest.mark.parametrize("lens,block_size,num_heads,num_kv_heads,head_dim,dtype", PREFILL, ids=_ids)
def test_prefill(lens, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
    if isinstance(lens, int):
        rng = random.Random(lens)
        seq_lens = [rng.randint(1, 400) for _ in range(lens)]
        lens = (seq_lens, [rng.randint(1, n) for n in seq_lens])
    case = make_case(*lens, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda",
                     seed=len(lens[0]) + head_dim, garbage=float("nan"))
    out = _attend(case)
    assert out.dtype == dtype and rel_err(out, reference_attention(case)) < TOL[dtype]


@pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 9), reason="e4m3 conversions need sm_89 or later")
@pytest.mark.parametrize("lens,block_size,num_heads,num_kv_heads,head_dim", [
    (([800] * 5 + [192], [800] * 5 + [192]), 16, 32, 8, 128),   # an offline prefill step's prompts, unmasked tiles
    (([300, 1000], [37, 1000]), 32, 16, 2, 64),                  # chunks after a cached prefix
    (([129, 5], [129, 5]), 16, 8, 8, 128),                       # tails shorter than a key tile
])
def test_prefill_on_e4m3_cache(lens, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Prefill attention reading an e4m3 cache (kv_cache_dtype="fp8"), against float64 attention over the values
    the cache holds."""
    case = as_e4m3(make_case(*lens, num_heads, num_kv_heads, head_dim, block_size, BF16, "cuda", seed=head_dim,
                             garbage=float("nan")))
    out = _attend(case)
    assert out.dtype == BF16 and rel_err(out, reference_attention(case)) < TOL[BF16]


@pytest.mark.parametrize("kv_dtype", [BF16, pytest.param(torch.float8_e4m3fn, marks=pytest.mark.skipif(
    torch.cuda.get_device_capability() < (8, 9), reason="e4m3 conversions need sm_89 or later"))], ids=_ids)
@pytest.mark.parametrize("query_lens", [[1] * 6, [40, 1, 300, 7, 1, 64]], ids=["decode", "prefill"])
def test_token_major_cache(query_lens: list[int], kv_dtype: torch.dtype) -> None:
    """The kernels index caches by strides: contiguous [block, token, KV head, d] caches (the other tests use the
    engine's head-major storage) give the same answer."""
    seq_lens = [1100, 17, 300, 900, 64, 64]
    cases = [make_case(seq_lens, query_lens, 32, 8, 128, 16, BF16, "cuda", seed=5, garbage=float("nan"),
                       head_major=head_major) for head_major in (True, False)]
    if kv_dtype != BF16:
        cases = [as_e4m3(case) for case in cases]
    assert cases[1].k_cache.is_contiguous() and not cases[0].k_cache.is_contiguous()
    outs = [_attend(case) for case in cases]
    assert rel_err(outs[1], reference_attention(cases[1])) < TOL[BF16]
    assert torch.equal(outs[0], outs[1])


def test_short_block_table_stays_in_bounds() -> None:
    """The runner's memory-profiling forward attends over 300 tokens through a one-entry table."""
    k_cache = torch.zeros(2, 16, 2, 64, dtype=BF16, device="cuda")
    q = torch.randn(300, 8, 64, dtype=BF16, device="cuda")
    out = triton_ops.paged_attention(q, k_cache, k_cache.clone(), torch.tensor([0, 300], dtype=torch.int32,
                                     device="cuda"), torch.tensor([300], dtype=torch.int32, device="cuda"),
                                     torch.zeros(1, 1, dtype=torch.int32, device="cuda"), 0.125, 300)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("kv_dtype", [BF16, pytest.param(torch.float8_e4m3fn, marks=pytest.mark.skipif(
    torch.cuda.get_device_capability() < (8, 9), reason="e4m3 conversions need sm_89 or later"))], ids=_ids)
@pytest.mark.parametrize("table_width", [4, 80])  # one partition, several partitions
def test_decode_cuda_graph_replay_matches_eager(table_width: int, kv_dtype: torch.dtype) -> None:
    """Contexts grown after capture read slots the case never wrote (finite garbage), the same way in both runs."""
    case = make_case([60, 33, 17], [1, 1, 1], 32, 8, 128, 16, BF16, "cuda", seed=7, table_width=table_width)
    args = (case.q, case.k_cache.to(kv_dtype), case.v_cache.to(kv_dtype), case.query_start_loc, case.seq_lens,
            case.block_tables, case.scale, 1)
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


def _fused_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, device="cuda")
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
            v.view(-1, num_kv_heads, head_dim))


def _cos_sin(head_dim: int, max_pos: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().cuda()


ROPE = [(1, 8, 8, 64, BF16), (7, 32, 8, 128, BF16), (256, 28, 4, 128, F32), (2048, 32, 8, 128, BF16),
        (33, 16, 2, 96, F32)]


@pytest.mark.parametrize("head_major", [True, False], ids=["head_major", "token_major"])
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim,dtype", ROPE, ids=_ids)
def test_rope_and_cache(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, head_major: bool) -> None:
    block_size = 16
    q, k, v = _fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
    cos_sin = _cos_sin(head_dim, 4096)
    num_blocks = num_tokens // block_size + 2
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[::3] = -1
    shape = (num_blocks, num_kv_heads, block_size, head_dim) if head_major else (num_blocks, block_size,
                                                                                   num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    if head_major:
        k_cache = k_cache.transpose(1, 2)
    v_cache = k_cache.clone()
    q_out = triton_ops.rope_and_cache(positions, q, k, v, cos_sin, k_cache, v_cache, slots)

    f64 = [t.double() for t in (q, k, v)]
    ref_k_cache = torch.full(k_cache.shape, float("nan"), dtype=torch.float64, device="cuda")
    ref_v_cache = ref_k_cache.clone()
    ref_q = torch_ref.rope_and_cache(positions, *f64, cos_sin.double(), ref_k_cache, ref_v_cache, slots)
    assert rel_err(q_out, ref_q) < TOL[dtype]
    written = ~ref_k_cache.isnan()
    assert torch.equal(written, ~k_cache.isnan()) and torch.equal(written, ~v_cache.isnan())
    assert rel_err(k_cache[written], ref_k_cache[written]) < TOL[dtype]
    assert torch.equal(v_cache[written], ref_v_cache[written].to(dtype))

    q_rot, k_rot = triton_ops.rotary_embedding(positions, q, k, cos_sin)
    ref_q_rot, ref_k_rot = torch_ref.rotary_embedding(positions, f64[0], f64[1], cos_sin.double())
    assert rel_err(q_rot, ref_q_rot) < TOL[dtype] and rel_err(k_rot, ref_k_rot) < TOL[dtype]

    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    triton_ops.write_kv_cache(k, v, k_cache, v_cache, slots)
    torch_ref.write_kv_cache(*f64[1:], ref_k_cache, ref_v_cache, slots)
    assert torch.equal(written, ~k_cache.isnan())
    assert torch.equal(k_cache[written], ref_k_cache[written].to(dtype))
    assert torch.equal(v_cache[written], ref_v_cache[written].to(dtype))


# batch, longest context, block size, query heads, kv heads, head dim, dtype, block table width (0: as needed)
DECODE_ROPE = [
    (1, 1, 16, 8, 8, 64, BF16, 0),          # only the new token
    (1, 150, 16, 32, 8, 128, BF16, 512),    # batch 1 as a CUDA-graph runner sees it: a table for 8,192 tokens
    (1, 4000, 16, 32, 8, 128, BF16, 0),     # partitions merged
    (3, 700, 32, 32, 4, 128, F32, 0),
    (16, 300, 8, 64, 8, 128, BF16, 0),      # GQA 8
    (33, 513, 32, 28, 4, 128, F32, 0),      # group of 7 heads
    (64, 1100, 16, 32, 8, 128, BF16, 0),
    (256, 200, 16, 32, 8, 64, BF16, 0),
    (2, 200, 16, 8, 8, 96, F32, 0),         # head dim that is not a power of two
    (2, 1000, 16, 8, 8, 64, BF16, 0),       # no GQA, partitions merged
    (4, 2000, 16, 28, 4, 128, BF16, 0),     # group of 7 heads, partitions merged
    (1, 257, 16, 32, 8, 128, BF16, 0),      # the new token alone in the last 256-token partition
    (1, 256, 16, 32, 8, 128, BF16, 0),      # ... the last token of the only one
    (1, 65, 16, 32, 8, 128, BF16, 512),     # a short context split: the new token alone in the second 64 tokens
    (1, 1100, 16, 32, 8, 128, BF16, 512),   # ... into 9 partitions of 128 tokens
    (2, 130, 16, 32, 8, 128, F32, 512),     # ... float32's 32-token tiles
    (40, 1025, 16, 28, 4, 128, F32, 0),     # a grid too large to read before the wait: group of 7, float32
]


@pytest.mark.parametrize("batch,max_ctx,block_size,num_heads,num_kv_heads,head_dim,dtype,width", DECODE_ROPE,
                         ids=_ids)
def test_decode_attention_rotates_writes_and_attends(batch: int, max_ctx: int, block_size: int, num_heads: int,
                                                     num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                                                     width: int) -> None:
    """The fused decode step against rotary, cache write and dense attention in float64: the new token's slot
    holds NaN until the kernel writes it (reading it first fails), a padding row (context 1, position 0, slot
    -1, as the graph runner pads) writes nothing, and no other slot changes."""
    rng = random.Random(batch * max_ctx + head_dim)
    seq_lens = [max_ctx] + [rng.randint(1, max_ctx) for _ in range(batch - 1)]
    padding = batch >= 3
    if padding:
        seq_lens[-1] = 1
    case = make_case(seq_lens, [1] * batch, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda",
                     seed=batch + max_ctx, garbage=float("nan"), table_width=width)
    q, k, v = _fused_qkv(batch, num_heads, num_kv_heads, head_dim, dtype)
    positions = case.seq_lens.long() - 1
    tables = case.block_tables.long()
    rows = torch.arange(batch, device="cuda")
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    if padding:
        slots[-1] = -1
    new = slots[slots >= 0]
    at = (new // block_size, new % block_size)  # the caches are strided views (head-major)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    k_cache[at] = float("nan")
    v_cache[at] = float("nan")
    before_k, before_v = k_cache.clone(), v_cache.clone()
    cos_sin = _cos_sin(head_dim, max_ctx)
    out = triton_ops.decode_attention(positions, q, k, v, cos_sin, k_cache, v_cache, slots, case.query_start_loc,
                                      case.seq_lens, case.block_tables, case.scale)

    q_rot, k_rot = torch_ref.rotary_embedding(positions, q.double(), k.double(), cos_sin.double())
    keys = [torch.cat((old[:n - 1], k_rot[i:i + 1].cpu())) for i, (old, n) in enumerate(zip(case.keys, seq_lens))]
    values = [torch.cat((old[:n - 1], v[i:i + 1].double().cpu()))
              for i, (old, n) in enumerate(zip(case.values, seq_lens))]
    real = slice(0, batch - 1 if padding else batch)
    ref = reference_attention(dataclasses.replace(case, q=q_rot, keys=keys, values=values))
    assert out.dtype == dtype and rel_err(out[real], ref[real]) < TOL[dtype]
    assert rel_err(k_cache[at], k_rot[real]) < TOL[dtype]
    assert torch.equal(v_cache[at], v[real])
    untouched = torch.ones(k_cache.shape[:2], dtype=torch.bool, device="cuda")
    untouched[at] = False
    for after, before in ((k_cache, before_k), (v_cache, before_v)):
        assert torch.equal(after[untouched].nan_to_num(7.0), before[untouched].nan_to_num(7.0))
    assert counters(out.device, batch * num_kv_heads).count_nonzero() == 0


# batch, longest context, block size, query heads, kv heads, head dim, block table width (0: as needed)
DECODE_ROPE_E4M3 = [
    (1, 1, 16, 8, 8, 64, 0),             # only the new token
    (1, 150, 16, 32, 8, 128, 512),       # batch 1 as a CUDA-graph runner sees it
    (1, 1100, 16, 32, 8, 128, 512),      # a short context split into 128-token partitions
    (1, 4000, 16, 32, 8, 128, 0),        # partitions merged
    (16, 300, 8, 64, 8, 128, 0),         # GQA 8, 128 (sequence, KV head) pairs: still one launch on 132 SMs
    (64, 1100, 16, 32, 8, 128, 0),       # a full batch: rope_and_cache, then triton_fp8_decode
]


@pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 9), reason="e4m3 conversions need sm_89 or later")
@pytest.mark.parametrize("batch,max_ctx,block_size,num_heads,num_kv_heads,head_dim,width", DECODE_ROPE_E4M3,
                         ids=_ids)
def test_decode_attention_on_e4m3_cache(batch: int, max_ctx: int, block_size: int, num_heads: int,
                                        num_kv_heads: int, head_dim: int, width: int) -> None:
    """A decode step on an e4m3 cache (kv_cache_dtype="fp8"; one launch in small batches, fuses_rope) writes
    the very bits rope_and_cache writes, touches no other byte, and attends as float64 attention over the values
    the cache then holds."""
    rng = random.Random(batch * max_ctx + head_dim)
    seq_lens = [max_ctx] + [rng.randint(1, max_ctx) for _ in range(batch - 1)]
    case = as_e4m3(make_case(seq_lens, [1] * batch, num_heads, num_kv_heads, head_dim, block_size, BF16, "cuda",
                             seed=batch + max_ctx, garbage=float("nan"), table_width=width))
    q, k, v = _fused_qkv(batch, num_heads, num_kv_heads, head_dim, BF16)
    positions = case.seq_lens.long() - 1
    tables = case.block_tables.long()
    slots = tables[torch.arange(batch, device="cuda"), positions // block_size] * block_size + positions % block_size
    at = (slots // block_size, slots % block_size)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    for cache in (k_cache, v_cache):  # float8 tensors index through a byte view; 0x7F is e4m3's NaN
        cache.view(torch.uint8)[at] = 0x7F
    k_two, v_two = k_cache.clone(), v_cache.clone()
    cos_sin = _cos_sin(head_dim, max_ctx)
    out = triton_ops.decode_attention(positions, q, k, v, cos_sin, k_cache, v_cache, slots, case.query_start_loc,
                                      case.seq_lens, case.block_tables, case.scale)
    q_rot = triton_ops.rope_and_cache(positions, q, k, v, cos_sin, k_two, v_two, slots)

    small = batch * num_kv_heads <= torch.cuda.get_device_properties(0).multi_processor_count
    assert triton_attention.fuses_rope(q, k_cache) == small
    assert torch.equal(k_cache.view(torch.uint8), k_two.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_two.view(torch.uint8))
    k_new, v_new = (cache.view(torch.uint8)[at].view(cache.dtype).double().cpu() for cache in (k_cache, v_cache))
    keys = [torch.cat((old[:n - 1], k_new[i:i + 1])) for i, (old, n) in enumerate(zip(case.keys, seq_lens))]
    values = [torch.cat((old[:n - 1], v_new[i:i + 1])) for i, (old, n) in enumerate(zip(case.values, seq_lens))]
    ref = reference_attention(dataclasses.replace(case, q=q_rot, keys=keys, values=values))
    assert out.dtype == BF16 and rel_err(out, ref) < TOL[BF16]
    assert counters(out.device, batch * num_kv_heads).count_nonzero() == 0


NORM = [((1, 4096), BF16), ((7, 4096), BF16), ((256, 5120), F32), ((1000, 8192), BF16), ((3, 100), F32)]


@pytest.mark.parametrize("shape,dtype", NORM, ids=_ids)
def test_rms_norms(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape, dtype=dtype, device="cuda")
    weight = (torch.rand(shape[-1], device="cuda") + 0.5).to(dtype)
    x_in = x.clone()
    assert rel_err(triton_ops.rms_norm(x, weight, 1e-6), torch_ref.rms_norm(x.double(), weight.double(), 1e-6)) \
        < TOL[dtype]
    assert rel_err(triton_ops.rms_norm(x, None, 1e-6), torch_ref.rms_norm(x.double(), None, 1e-6)) < TOL[dtype]
    assert torch.equal(x, x_in)


def test_rms_norm_on_strided_heads() -> None:
    """q_norm/k_norm style: per-head norm of a strided view into a fused qkv output."""
    q, k, _ = _fused_qkv(37, 16, 4, 128, BF16)
    weight = torch.rand(128, device="cuda", dtype=BF16) + 0.5
    for x in (q, k):
        assert rel_err(triton_ops.rms_norm(x, weight, 1e-6), torch_ref.rms_norm(x.double(), weight.double(), 1e-6)) \
            < TOL[BF16]


@pytest.mark.parametrize("shape,dtype", [((1, 2 * 11008), BF16), ((300, 2 * 14336), BF16), ((17, 2 * 768), F32),
                                         ((2, 3, 2 * 100), F32)], ids=_ids)
def test_silu_and_mul(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape, dtype=dtype, device="cuda")
    out = triton_ops.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert rel_err(out, torch_ref.silu_and_mul(x.double())) < TOL[dtype]


@pytest.mark.parametrize("rows,n", [(1, 128256), (3, 49152), (7, 100), (256, 4097), (2, 4096)])
def test_argmax(rows: int, n: int) -> None:
    """torch.argmax's answer, ties to the lowest index included, on a strided view (the sampler cuts padded
    vocabulary columns off)."""
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    logits = torch.randn(rows, n + 3, device="cuda", generator=gen)[:, :n]
    logits[0, n - 1] = logits[0, n // 3] = 1e4  # a tie across chunks: the first wins
    logits[-1, : n // 2] = float("-inf")
    if rows > 1:
        logits[1] = 0.5  # a row of equal values: index 0
    got = triton_ops.argmax(logits)
    assert got.dtype == torch.long and torch.equal(got, logits.argmax(dim=-1))
    assert counters(got.device, rows).count_nonzero() == 0
    buffer = torch.full((rows + 2,), -5, dtype=torch.long, device="cuda")
    assert triton_ops.argmax(logits, buffer[:rows]).data_ptr() == buffer.data_ptr()  # into a caller's buffer
    assert torch.equal(buffer[:rows], got) and buffer[rows:].tolist() == [-5, -5]


@pytest.mark.parametrize("rows,n", [(1, 128256), (3, 49152), (7, 100), (256, 4097)])
def test_race_argmax(rows: int, n: int) -> None:
    """The argmax of logits * inv_temp - log(noise) in float64 on a strided view of padded logits, into a caller's
    buffer; rows whose two best scores lie within float32 rounding of each other may pick either."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, n + 64, device="cuda", generator=gen) * 4)[:, :n]
    inv_temps = torch.rand(rows, device="cuda", generator=gen) + 0.5
    noise = torch.empty(rows, n, device="cuda").exponential_(generator=gen)
    scores = logits.double() * inv_temps.double()[:, None] - noise.double().log()
    top2 = scores.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4 * top2[:, 0].abs().clamp_min(1.0)
    buffer = torch.empty(rows + 5, dtype=torch.long, device="cuda")
    got = triton_ops.race_argmax(logits, inv_temps, noise, buffer[:rows])
    assert got.data_ptr() == buffer.data_ptr() and clear.float().mean() > 0.9
    assert torch.equal(got[clear], scores.argmax(-1)[clear])


@pytest.mark.parametrize("n", [1, 7, 256, 700])
def test_fill_pending(n: int) -> None:
    """Rows with a source take that sampled token, every other row keeps its id (the twin's answer)."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    buffer = torch.full((n + 300,), -5, dtype=torch.long, device="cuda")  # rows past n must stay as they are
    ids = buffer[:n]
    ids.copy_(torch.randint(0, 1000, (n,), device="cuda", generator=gen))
    sampled = torch.randint(1000, 2000, (300,), device="cuda", generator=gen)
    token_src = torch.randint(-300, 300, (n + 300,), device="cuda", generator=gen).clamp(min=-1)
    expected = ids.clone()
    torch_ref.fill_pending(expected, token_src[:n], sampled)
    triton_ops.fill_pending(ids, token_src[:n], sampled)
    assert torch.equal(ids, expected) and bool((buffer[n:] == -5).all())
