"""The torch twins against naive float64 implementations: they are the CPU path and the Triton oracle."""
from __future__ import annotations

import pytest
import torch

from paged_cases import make_case, reference_attention, rel_err
from tokenmill.kernels import torch_ref

BLOCK_SIZES = (1, 16, 32)
HEADS = ((8, 8), (8, 2), (16, 2))  # GQA ratios 1, 4, 8
HEAD_DIMS = (64, 128)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_paged_decode(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    seq_lens = [1, 17, 100, 333, 50]
    case = make_case(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size,
                     torch.float32, "cpu", seed=block_size + num_kv_heads + head_dim)
    out = torch_ref.paged_attention(case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                                    case.block_tables, case.scale, 1)
    assert rel_err(out, reference_attention(case)) < 1e-5


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_paged_prefill_chunked(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    # fresh prompt, chunk after a cached prefix, a decode row in the batch, a sequence with no query
    seq_lens, query_lens = [40, 77, 130, 5, 64], [40, 13, 1, 5, 0]
    case = make_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu",
                     seed=block_size * num_kv_heads + head_dim)
    out = torch_ref.paged_attention(case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                                    case.block_tables, case.scale, case.max_query_len)
    assert rel_err(out, reference_attention(case)) < 1e-5


def test_paged_attention_bf16() -> None:
    case = make_case([70, 300], [70, 20], 8, 2, 64, 16, torch.bfloat16, "cpu", seed=3)
    out = torch_ref.paged_attention(case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                                    case.block_tables, case.scale, case.max_query_len)
    assert out.dtype == torch.bfloat16 and rel_err(out, reference_attention(case)) < 1e-2


def _fused_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model makes them: strided views of one fused projection output."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
            v.view(-1, num_kv_heads, head_dim))


def _naive_rope(positions: torch.Tensor, x: torch.Tensor, base: float) -> torch.Tensor:
    """Neox rotary as complex multiplication: (x1 + i x2) * e^(i pos theta_j), in float64."""
    half = x.shape[-1] // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angle = positions.double()[:, None, None] * theta
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat((z.real, z.imag), dim=-1)


def _cos_sin(head_dim: int, max_pos: int, base: float) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


def _naive_cache_write(cache: torch.Tensor, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    out = cache.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[slot // cache.shape[1], slot % cache.shape[1]] = x[t].to(cache.dtype)
    return out


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_rotary_embedding(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    base = 10000.0
    positions = torch.tensor([0, 1, 5, 77, 4095, 1000, 3])
    q, k, _ = _fused_qkv(len(positions), num_heads, num_kv_heads, head_dim, torch.float32)
    q_rot, k_rot = torch_ref.rotary_embedding(positions, q, k, _cos_sin(head_dim, 4096, base))
    assert rel_err(q_rot, _naive_rope(positions, q, base)) < 1e-5
    assert rel_err(k_rot, _naive_rope(positions, k, base)) < 1e-5


@pytest.mark.parametrize("head_major", [True, False], ids=["head_major", "token_major"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_write_kv_cache_skips_padding(block_size: int, head_major: bool) -> None:
    """Also into the engine's head-major storage, a strided view: the writes land in the storage itself."""
    num_blocks, num_kv_heads, head_dim = 6, 2, 64
    if head_major:
        k_cache = torch.full((num_blocks, num_kv_heads, block_size, head_dim), float("nan")).transpose(1, 2)
    else:
        k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    slots = torch.randperm(num_blocks * block_size)[:5].tolist()
    slots[1] = slots[3] = -1
    _, k, v = _fused_qkv(5, 4, num_kv_heads, head_dim, torch.float32)
    torch_ref.write_kv_cache(k, v, k_cache, v_cache, torch.tensor(slots))
    empty = torch.full_like(k_cache, float("nan"))
    torch.testing.assert_close(k_cache, _naive_cache_write(empty, k, slots), equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, _naive_cache_write(empty, v, slots), equal_nan=True, rtol=0, atol=0)


def test_rope_and_cache() -> None:
    base, block_size, num_heads, num_kv_heads, head_dim = 500000.0, 16, 8, 2, 128
    positions = torch.tensor([3, 4, 0, 70, 71])
    slots = [19, 20, -1, 5, 33]
    q, k, v = _fused_qkv(len(positions), num_heads, num_kv_heads, head_dim, torch.float32)
    k_cache = torch.full((4, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    q_rot = torch_ref.rope_and_cache(positions, q, k, v, _cos_sin(head_dim, 128, base), k_cache, v_cache,
                                     torch.tensor(slots))
    assert rel_err(q_rot, _naive_rope(positions, q, base)) < 1e-5
    empty = torch.full_like(k_cache, float("nan"), dtype=torch.float64)
    want_k = _naive_cache_write(empty, _naive_rope(positions, k, base), slots)
    written = ~want_k.isnan()
    assert torch.equal(written, ~k_cache.isnan())
    assert rel_err(k_cache[written], want_k[written]) < 1e-5
    torch.testing.assert_close(v_cache, _naive_cache_write(torch.full_like(v_cache, float("nan")), v, slots),
                               equal_nan=True, rtol=0, atol=0)


def _naive_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.double()
    x = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return x if weight is None else x * weight.double()


@pytest.mark.parametrize("shape", [(1, 64), (7, 4096), (5, 3, 128)])
def test_rms_norm(shape: tuple[int, ...]) -> None:
    eps = 1e-6
    x = torch.randn(shape)
    weight = torch.rand(shape[-1]) + 0.5
    assert rel_err(torch_ref.rms_norm(x, weight, eps), _naive_rms_norm(x, weight, eps)) < 1e-5
    assert rel_err(torch_ref.rms_norm(x, None, eps), _naive_rms_norm(x, None, eps)) < 1e-5


@pytest.mark.parametrize("rows", [1, 5])
def test_linear_with_folded_norm_and_residual(rows: int) -> None:
    """A norm folded into the weight gives the unfolded norm-then-linear; the residual is added; out_dtype casts."""
    x, residual = torch.randn(rows, 96) * 3, torch.randn(rows, 40)
    weight, bias, gamma = torch.randn(40, 96), torch.randn(40), torch.rand(96) + 0.5
    want = _naive_rms_norm(x, gamma, 1e-6) @ weight.double().T + bias.double()
    folded = weight * gamma
    assert rel_err(torch_ref.linear(x, folded, bias, rms_eps=1e-6), want) < 1e-5
    got = torch_ref.linear(x, folded, bias, rms_eps=1e-6, residual=residual, out_dtype=torch.float64)
    assert got.dtype == torch.float64 and rel_err(got, want + residual.double()) < 1e-5


def test_silu_and_mul() -> None:
    x = torch.randn(9, 2 * 352)
    gate, up = x.double().chunk(2, dim=-1)
    want = gate / (1 + torch.exp(-gate)) * up
    assert rel_err(torch_ref.silu_and_mul(x), want) < 1e-6


def test_decode_row_does_not_depend_on_batch_mates() -> None:
    """With one thread (as CI runs), a sequence's decode attention is bit-identical alone and beside longer
    contexts: keys are padded to KV_PAD. (With more threads torch's SDPA splits work by batch size, see
    docs/ARCHITECTURE.md.) float32 shows the last bits that bf16 output would mostly round away."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        case = make_case([45, 200, 7, 129], [1, 1, 1, 1], num_heads=9, num_kv_heads=3, head_dim=64, block_size=1,
                         dtype=torch.float32, device="cpu", garbage=0.0)
        both = torch_ref.paged_attention(case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                                         case.block_tables, case.scale, 1)
        for i in range(4):
            alone = torch_ref.paged_attention(case.q[i:i + 1], case.k_cache, case.v_cache,
                                              case.query_start_loc[:2], case.seq_lens[i:i + 1],
                                              case.block_tables[i:i + 1], case.scale, 1)
            assert torch.equal(alone, both[i:i + 1])
    finally:
        torch.set_num_threads(threads)


def test_short_query_runs_attend_like_decode() -> None:
    """Speculative verification (a few query tokens per sequence) gives each token bit for bit what decoding it
    alone gives, so verified greedy tokens cannot differ from plain decoding's (one thread, as CI runs; float32
    shows the last bits that bf16 output would mostly round away)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        case = make_case([40, 97, 12], [5, 1, 3], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                         dtype=torch.float32, device="cpu", garbage=0.0)
        out = torch_ref.paged_attention(case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                                        case.block_tables, case.scale, case.max_query_len)
        starts = case.query_start_loc.tolist()
        for i, seq_len in enumerate(case.seq_lens.tolist()):
            for j in range(starts[i], starts[i + 1]):
                position = seq_len - (starts[i + 1] - j)
                alone = torch_ref.paged_attention(case.q[j:j + 1], case.k_cache, case.v_cache,
                                                  torch.tensor([0, 1], dtype=torch.int32),
                                                  torch.tensor([position + 1], dtype=torch.int32),
                                                  case.block_tables[i:i + 1], case.scale, 1)
                assert torch.equal(out[j:j + 1], alone)
        assert rel_err(out, reference_attention(case)) < 1e-5
    finally:
        torch.set_num_threads(threads)


def test_fill_pending_takes_sampled_tokens_where_a_row_has_a_source() -> None:
    ids = torch.tensor([5, 6, 7, 8, 9])
    torch_ref.fill_pending(ids, torch.tensor([-1, 2, -1, 0, -1]), torch.tensor([40, 41, 42]))
    assert ids.tolist() == [5, 42, 7, 40, 9]


def test_argmax_into_a_buffer() -> None:
    buffer = torch.zeros(4, dtype=torch.long)
    torch_ref.argmax(torch.tensor([[0.0, 3.0, 3.0], [2.0, 1.0, 0.0]]), buffer[:2])
    assert buffer.tolist() == [1, 0, 0, 0]


def test_race_argmax_is_the_exponential_race() -> None:
    """argmax(logits / T - log E) is the token argmax(softmax(logits / T) / E) picks (float64 reference), into a
    caller's buffer."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(200, 1000, generator=gen) * 3
    inv_temps = torch.rand(200, generator=gen) + 0.5
    noise = torch.empty(200, 1000).exponential_(generator=gen)
    want = (torch.softmax(logits.double() * inv_temps.double()[:, None], -1) / noise.double()).argmax(-1)
    buffer = torch.empty(300, dtype=torch.long)
    got = torch_ref.race_argmax(logits, inv_temps, noise, buffer[:200])
    assert torch.equal(got, want) and torch.equal(buffer[:200], want)
