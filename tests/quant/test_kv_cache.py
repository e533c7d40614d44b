"""Quantized KV caches on the torch twins: int8 rows (values + in-band scale) and fp8 written by the cache
write and read back by paged attention; pool sizing; fp8 scale folding leaves the model's function intact."""
from __future__ import annotations

import pytest
import torch
from paged_cases import make_case, reference_attention, rel_err
from quant_helpers import randomize, tiny_config

from tokenmill.kernels import quant_ref, torch_ref
from tokenmill.model.loader import load_model
from tokenmill.model.presets import get_preset
from tokenmill.quant.corpus import WindowRunner
from tokenmill.quant.formats import QuantFormat
from tokenmill.quant.kv_cache import fold_fp8_kv_scales, kv_cache_torch_dtype, kv_row_width
from tokenmill.quant.loading import linear_modules, quantize_model
from tokenmill.runner.model_runner import kv_bytes_per_token


def _quantize_cache(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    nb, bs, h, d = cache.shape
    return quant_ref.to_kv_cache(cache.reshape(nb * bs, h, d), dtype).view(nb, bs, h, kv_row_width(d, dtype))


def test_int8_rows_round_trip() -> None:
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    rows = quant_ref.quantize_kv_int8(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((quant_ref.dequantize_kv_int8(rows) - x).abs() <= scale / 2 * (1 + 1e-5)).all())
    assert torch.equal(quant_ref.dequantize_kv_int8(quant_ref.quantize_kv_int8(torch.zeros(2, 1, 8))), torch.zeros(2, 1, 8))


def test_fp8_write_saturates() -> None:
    out = quant_ref.to_kv_cache(torch.tensor([1e4, -1e4, 1.0]), torch.float8_e4m3fn).float()
    assert out.tolist() == [448.0, -448.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("seq_lens,query_lens", [([20, 7, 33], [1, 1, 1]), ([40, 9], [40, 3])])
def test_paged_attention_on_quantized_cache(dtype: torch.dtype, seq_lens: list[int], query_lens: list[int]) -> None:
    case = make_case(seq_lens, query_lens, 8, 2, 64, 4, torch.float32, "cpu")
    k, v = _quantize_cache(case.k_cache, dtype), _quantize_cache(case.v_cache, dtype)
    out = torch_ref.paged_attention(case.q, k, v, case.query_start_loc, case.seq_lens, case.block_tables,
                                    case.scale, case.max_query_len)
    assert rel_err(out, reference_attention(case)) < (0.02 if dtype == torch.int8 else 0.06)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_write_then_read_matches_direct(dtype: torch.dtype) -> None:
    """write_kv_cache into a quantized pool (padding slots skipped) stores exactly to_kv_cache's rows."""
    k, v = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    slots = torch.tensor([5, 0, -1, 9, 3, 12, 7, -1, 1, 14])
    shape = (4, 4, 2, kv_row_width(16, dtype))
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    torch_ref.write_kv_cache(k, v, k_cache, v_cache, slots)
    flat = k_cache.view(16, 2, -1)
    valid = slots >= 0
    assert torch.equal(flat[slots[valid]].view(torch.uint8), quant_ref.to_kv_cache(k[valid], dtype).view(torch.uint8))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots[valid]] = False
    assert not flat[untouched].view(torch.uint8).any()


def test_pool_sizes() -> None:
    """fp8 halves the bytes of a 16-bit cache exactly; int8 nearly (4 scale bytes per head_dim values)."""
    cfg = get_preset("llama-3-8b")
    bf16 = kv_bytes_per_token(cfg, torch.bfloat16)
    assert kv_bytes_per_token(cfg, kv_cache_torch_dtype("fp8", torch.bfloat16)) * 2 == bf16
    assert kv_bytes_per_token(cfg, kv_cache_torch_dtype("int8", torch.bfloat16)) == bf16 // 2 * 132 // 128
    assert kv_cache_torch_dtype("auto", torch.float16) == torch.float16
    with pytest.raises(ValueError):
        kv_cache_torch_dtype("fp4", torch.float16)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("quantize", [False, True])
def test_fp8_scale_folding_is_exact(arch: str, quantize: bool) -> None:
    """Folding power-of-two K/V scales (forced large here) into projections (biases too), k_norm (Qwen3) and
    the softmax scale changes no logit beyond float rounding, in float and in INT4."""
    model = load_model(tiny_config(architecture=arch, qk_norm=arch == "Qwen3ForCausalLM", vocab_size=256),
                       None, "dummy", torch.float32, "cpu", seed=1)
    randomize(model, 0.1)
    if quantize:
        quantize_model(model, dict.fromkeys(linear_modules(model), QuantFormat.parse("int4-g32")))
    runner = WindowRunner(model, 24, torch.device("cpu"), torch.float32)
    ids = list(range(3, 27))
    before = runner.logprobs(ids)
    assert fold_fp8_kv_scales(model, [(3000.0, 5000.0), (1.0, 100.0)]) == [(16.0, 32.0), (1.0, 1.0)]
    assert torch.allclose(before, runner.logprobs(ids), atol=1e-4)
