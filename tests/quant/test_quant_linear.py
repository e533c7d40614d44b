"""QuantLinear / QuantMergedLinear and the CPU twin: shard loading (float or packed), forward against the
dequantized weight on odd shapes and batches 1-64, and the checkpoint bookkeeping of load_weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import torch_ref
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
    torch.manual_seed(0)
    lin = MergedLinear(40, [8, 24], bias=True).to(torch.bfloat16)
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    q = to_quant_linear(lin, QuantFormat.parse("int8"), lin.weight.data)
    assert isinstance(q, QuantMergedLinear) and q.output_sizes == [8, 24] and q.bias.dtype == torch.bfloat16
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    want = lin(x).float()  # INT8 per row: ~0.6% (0.4-0.8% over 300 seeds); an elementwise bound failed 1 draw in 40
    assert (q(x).float() - want).norm() / want.norm() < 0.02


def test_fp8_rows_quantized_per_token() -> None:
    """Each row gets its own scale max|row| / 448 (its largest value becomes +-448), a zero row stays zeros with
    scale 0, and a row's e4m3 values do not depend on the other rows (a token's result on the batch)."""
    from tokenmill.kernels.quant_ref import quantize_fp8_rows
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=gen) * torch.tensor([1e-3, 1.0, 0.0, 50.0, 1e4])[:, None]
    q, s = quantize_fp8_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (5,)
    assert torch.equal(s, x.abs().amax(-1) / 448)
    assert torch.equal(q[2].float(), torch.zeros(300)) and s[2] == 0
    assert bool((q.float().abs().amax(-1)[[0, 1, 3, 4]] == 448).all())
    for i in range(5):
        qi, si = quantize_fp8_rows(x[i:i + 1])
        assert torch.equal(qi.view(torch.uint8), q[i:i + 1].view(torch.uint8)) and torch.equal(si, s[i:i + 1])


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 70, 100), (7, 33, 576), (64, 130, 1000)])
def test_fp8_twin_is_the_product_of_the_quantized_operands(m: int, n: int, k: int) -> None:
    """FP8 quantizes x per row too: the twin equals, to float32 summation, the float64 product of both e4m3
    operands scaled back, and stays within e4m3's rounding of the exact product."""
    from tokenmill.kernels.quant_ref import quantize_fp8_rows
    f = QuantFormat.parse("fp8")
    gen = torch.Generator().manual_seed(m * n + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    b, r = torch.randn(n, generator=gen), torch.randn(m, n, generator=gen)
    qw = quantize(w, f)
    xq, xs = quantize_fp8_rows(x)
    want = (xq.double() * xs.double()[:, None]) @ qw.dequantize(torch.float64).T + b.double() + r.double()
    got = quant_linear(x, qw.qweight, qw.scales, None, k, k, b, residual=r)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)
    exact = x.double() @ w.double().T + b.double() + r.double()
    assert (got.double() - exact).norm() <= 0.1 * (exact.norm() + 1e-9)
    assert quant_linear(x.to(torch.bfloat16), qw.qweight, qw.scales, None, k, k, None).dtype == torch.bfloat16


def test_fp8_twin_row_independent_of_the_batch() -> None:
    """A row's FP8 output has the same bits alone as in any batch (a float32 GEMM gave one or two rows other last
    bits, which the next layer's e4m3 rounding turned into other greedy tokens on the default model)."""
    f = QuantFormat.parse("fp8")
    gen = torch.Generator().manual_seed(1)
    for n, k in [(576, 576), (1536, 576), (576, 1536)]:
        qw = quantize(torch.randn(n, k, generator=gen) * 0.05, f)
        x = torch.randn(9, k, generator=gen)
        whole = quant_linear(x, qw.qweight, qw.scales, None, k, k, None)
        for rows in (slice(0, 1), slice(3, 5), slice(2, 9)):
            assert torch.equal(quant_linear(x[rows], qw.qweight, qw.scales, None, k, k, None), whole[rows])


def test_fp8_layer_shards_and_forward() -> None:
    """A merged FP8 layer holds e4m3 weights with float32 scales a row; loading float or packed shards gives the
    stacked matrix's quantization, and forward is the twin's (CPU kernels are for integer formats only)."""
    f = QuantFormat.parse("fp8")
    sizes, k = [48, 16, 16], 96
    ws = [torch.randn(s, k) * 0.02 for s in sizes]
    a = QuantMergedLinear(k, sizes, False, f, "cpu", torch.bfloat16)
    b = QuantMergedLinear(k, sizes, False, f, "cpu", torch.bfloat16)
    for i, w in enumerate(ws):
        a.load_shard("weight", w, i)
        b.load_shard("weight", quantize(w, f), i)
    whole = quantize(torch.cat(ws), f)
    for layer in (a, b):
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
        assert torch.equal(layer.weight.view(torch.uint8), whole.qweight.view(torch.uint8))
        assert torch.equal(layer.weight_scale, whole.scales)
    x = torch.randn(5, k, dtype=torch.bfloat16)
    assert torch.equal(a(x), quant_linear(x, whole.qweight, whole.scales, None, k, k, None))
    with pytest.raises(ValueError, match="expects fp8"):
        a.load_shard("weight", quantize(ws[0], QuantFormat.parse("int8")), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "int4-g32"])
def test_silu_and_mul_of_gate_up(fmt: str, dtype: torch.dtype) -> None:
    """A merged gate/up layer's silu_and_mul (the twin in float32, torch's packed CPU kernel in bf16) is SiLU·mul
    of its forward, bias included, as the float layer's is; the model's MLP calls it."""
    f = QuantFormat.parse(fmt)
    gen = torch.Generator().manual_seed(7)
    lin = MergedLinear(64, [96, 96], bias=True).to(dtype)
    lin.weight.data.copy_(torch.randn(192, 64, generator=gen))
    lin.bias.data.copy_(torch.randn(192, generator=gen))
    q = to_quant_linear(lin, f, lin.weight.data)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    got = q.silu_and_mul(x)
    assert got.shape == (3, 96) and got.dtype == dtype
    assert torch.equal(got, torch_ref.silu_and_mul(q(x)))
    assert torch.equal(lin.silu_and_mul(x), torch_ref.silu_and_mul(lin(x)))
