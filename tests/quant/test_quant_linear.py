"""QuantLinear / QuantMergedLinear and the CPU twin: shard loading (float or packed), forward against the
dequantized weight on odd shapes and batches 1-64, and the checkpoint bookkeeping of load_weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels.quant_ref import quant_linear
from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.quant.formats import QuantFormat, quantize
from tokenmill.quant.linear import QuantLinear, QuantMergedLinear, to_quant_linear

FORMATS = ["int8", "int8-g32", "int4-g32", "int4-g64", "int4-g128"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 70, 100), (7, 33, 576), (16, 64, 200), (64, 130, 1000)])
def test_twin_matches_dequantized_linear(fmt: str, m: int, n: int, k: int) -> None:
    f = QuantFormat.parse(fmt)
    gen = torch.Generator().manual_seed(m * n + k)
    qw = quantize(torch.randn(n, k, generator=gen), f)
    x, b = torch.randn(m, k, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)
    want = F.linear(x, qw.dequantize(torch.float64), b)
    got = quant_linear(x.float(), qw.qweight, qw.scales, qw.mins, k, f.group(k), b.float())
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int4-g128"])
def test_merged_shards_float_and_packed(fmt: str) -> None:
    """Shards loaded as floats or as QuantizedWeights give the same layer as quantizing the stacked matrix."""
    f = QuantFormat.parse(fmt)
    sizes, k = [48, 16, 16], 96
    ws = [torch.randn(s, k) for s in sizes]
    bias = [torch.randn(s) for s in sizes]
    a = QuantMergedLinear(k, sizes, True, f, "cpu", torch.float32)
    b = QuantMergedLinear(k, sizes, True, f, "cpu", torch.float32)
    for i, (w, bb) in enumerate(zip(ws, bias)):
        a.load_shard("weight", w, i)
        b.load_shard("weight", quantize(w, f), i)
        a.load_shard("bias", bb, i)
        b.load_shard("bias", bb, i)
    whole = quantize(torch.cat(ws), f)
    for layer in (a, b):
        assert torch.equal(layer.weight, whole.qweight) and torch.equal(layer.weight_scale, whole.scales)
        assert isinstance(layer, MergedLinear) and isinstance(layer, Linear)
    x = torch.randn(5, k)
    assert torch.allclose(a(x), F.linear(x, whole.dequantize(), torch.cat(bias)), atol=1e-4)


def test_load_shard_errors() -> None:
    layer = QuantLinear(64, 32, False, QuantFormat.parse("int4-g32"), "cpu", torch.float32)
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.load_shard("weight", torch.randn(32, 63))
    with pytest.raises(ValueError, match="expects int4-g32"):
        layer.load_shard("weight", quantize(torch.randn(32, 64), QuantFormat.parse("int4-g64")))
    with pytest.raises(ValueError, match="bias"):
        layer.load_shard("bias", torch.randn(32))


def test_to_quant_linear_keeps_device_dtype_and_bias() -> None:
    lin = MergedLinear(40, [8, 24], bias=True).to(torch.bfloat16)
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    q = to_quant_linear(lin, QuantFormat.parse("int8"), lin.weight.data)
    assert isinstance(q, QuantMergedLinear) and q.output_sizes == [8, 24] and q.bias.dtype == torch.bfloat16
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    assert torch.allclose(q(x).float(), lin(x).float(), rtol=0.05, atol=0.1)
