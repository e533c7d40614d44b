"""torch's packed CPU kernels behind QuantLinear (kernels/cpu_quant.py) against the torch twin: exact up to the
16-bit rounding of the scales (reference_scales) and of the output, on the shapes and batches decode and prefill
use; QuantLinear takes them only where they fit, and a reloaded or rescaled weight is repacked."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.cpu_quant import cpu_quant_linear, prepack, reference_scales, supports
from tokenmill.kernels.quant_ref import quant_linear
from tokenmill.quant.formats import QuantFormat, quantize
from tokenmill.quant.linear import QuantLinear


def _case(fmt: str, n: int, k: int, m: int, dtype: torch.dtype):
    f = QuantFormat.parse(fmt)
    gen = torch.Generator().manual_seed(n + k + m)
    qw = quantize(torch.randn(n, k, generator=gen) * 0.05, f)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return f, qw, x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "int4-g128", "int8"])
@pytest.mark.parametrize("n,k,m", [(64, 128, 1), (960, 576, 1), (576, 1536, 7), (192, 576, 32), (3072, 576, 100)])
def test_kernel_matches_twin(fmt: str, n: int, k: int, m: int, dtype: torch.dtype) -> None:
    f, qw, x = _case(fmt, n, k, m, dtype)
    if not supports(f.bits, f.group(k), k, n, dtype):
        pytest.skip(f"no CPU kernel for {fmt} {n}x{k} in {dtype}")
    bias = torch.randn(n).to(dtype)
    got = cpu_quant_linear(x, prepack(qw.qweight, qw.scales, qw.mins, k, f.group(k), dtype), bias).float()
    s, mins = reference_scales(qw.scales, qw.mins, dtype)
    want = quant_linear(x.float(), qw.qweight, s, mins, k, f.group(k), bias.float())
    exact = quant_linear(x.float(), qw.qweight, qw.scales, qw.mins, k, f.group(k), bias.float())
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-2 * scale          # 16-bit output and accumulation order
    assert (got - exact).abs().max() <= 3e-2 * scale         # plus the scales' rounding to 16 bits


def test_supports() -> None:
    assert supports(4, 32, 576, 960, torch.bfloat16)
    assert not supports(4, 32, 576, 960, torch.float32)       # float32 activations: the twin
    assert not supports(4, 128, 576, 960, torch.bfloat16)     # a partial last group
    assert not supports(4, 32, 576, 100, torch.bfloat16)      # rows not a multiple of 16
    assert not supports(8, 32, 576, 960, torch.bfloat16)      # grouped INT8 (GGUF Q8_0): the twin
    assert supports(8, 576, 576, 960, torch.bfloat16)
    assert not supports(8, 40, 40, 32, torch.bfloat16)         # K not a multiple of 16


def _twin(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """What the kernel should compute: the twin with the scales rounded as prepack rounds them."""
    s, mins = reference_scales(layer.weight_scale, layer.weight_min, x.dtype)
    return quant_linear(x.float(), layer.weight, s, mins, layer.in_features, layer.group, layer.bias.float())


def test_quant_linear_uses_kernel_and_repacks() -> None:
    """The layout is made at first use and made again after the weight changes (rescaled rows, a new shard)."""
    layer = QuantLinear(128, 64, True, QuantFormat.parse("int4-g32"), "cpu", torch.bfloat16)
    layer.load_shard("weight", torch.randn(64, 128) * 0.05)
    layer.load_shard("bias", torch.randn(64))
    x = torch.randn(3, 128).to(torch.bfloat16)

    def check() -> None:
        want = _twin(layer, x)
        assert (layer(x).float() - want).abs().max() <= 1e-2 * want.abs().max()
        assert layer._cpu_packed is not None and layer._cpu_packed.bits == 4

    check()
    layer.scale_rows_(0, 32, 2.0)
    assert layer._cpu_packed is None
    check()
    layer.load_shard("weight", torch.randn(64, 128) * 0.05)
    assert layer._cpu_packed is None
    check()


def test_float32_layer_runs_the_twin() -> None:
    layer = QuantLinear(128, 64, False, QuantFormat.parse("int4-g32"), "cpu", torch.float32)
    layer.load_shard("weight", torch.randn(64, 128))
    x = torch.randn(2, 128)
    assert torch.equal(layer(x), quant_linear(x, layer.weight, layer.weight_scale, layer.weight_min, 128, 32, None))
    assert layer._cpu_packed is None
