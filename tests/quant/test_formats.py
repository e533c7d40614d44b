"""Quantize -> dequantize round trips within each format's bound, on random and real weights; the INT4
packing layout byte by byte; GGUF Q8_0 / Q4_0 / Q4_1 blocks equal to gguf's own dequantization, exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from tokenmill.model.gguf_loader import GGUFTensor, dequantize_tensor, iter_gguf_raw_tensors
from tokenmill.quant.formats import QuantFormat, _grouped, pack_int4, quantize, unpack_int4
from tokenmill.quant.gguf import gguf_to_quantized

FORMATS = ["int8", "int8-g32", "int4-g32", "int4-g64", "int4-g128"]


def _bound_ok(w: torch.Tensor, fmt: QuantFormat) -> None:
    """INT8: |error| <= scale / 2. INT4: |error| <= scale / 2 for values inside the group's grid [m, m + 15 s]
    (the fitted grid may clip a few outliers: those stay within 1.5 min-max steps), and no group's squared
    error exceeds plain min-max rounding's (fp16 scale and min rounding aside)."""
    qw = quantize(w, fmt)
    k, group = w.shape[1], fmt.group(w.shape[1])
    w = w.float()

    def per_input(t: torch.Tensor) -> torch.Tensor:
        return t.float().repeat_interleave(group, 1)[:, :k]

    step = per_input(qw.scales)
    err = (qw.dequantize() - w).abs()
    slack = 1e-3 * step + 1e-3 * w.abs()
    if fmt.bits == 8:
        assert bool((err <= step / 2 + slack).all())
        return
    low = per_input(qw.mins)
    inside = (w >= low) & (w <= low + 15 * step)
    assert bool((err[inside] <= step[inside] / 2 + slack[inside]).all())
    g = _grouped(w, group)
    lo, span = g.amin(-1), (g.amax(-1) - g.amin(-1)) / 15
    assert bool((err <= 1.5 * per_input(span) + slack).all())
    rtn = ((((g - lo[..., None]) / span.clamp_min(1e-30)[..., None]).round() * span[..., None] + lo[..., None] - g)
           ** 2).sum(-1)
    ours = torch.nn.functional.pad((qw.dequantize() - w) ** 2, (0, -k % group)).view(g.shape).sum(-1)
    assert bool((ours <= rtn * 1.01 + group * (1e-3 * g.abs().amax(-1)) ** 2).all())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 31), (17, 100), (64, 576), (5, 1000)])
def test_round_trip_random(fmt: str, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) + 0.3 * torch.rand(1)
    _bound_ok(w, QuantFormat.parse(fmt))


def test_round_trip_constant_and_zero_rows() -> None:
    """Zero rows stay exactly zero (no division by a zero scale); INT4 keeps constant groups exactly (min)."""
    w = torch.zeros(4, 96)
    w[1] = 0.25
    for fmt in FORMATS:
        out = quantize(w, QuantFormat.parse(fmt)).dequantize()
        assert torch.equal(out[[0, 2, 3]], w[[0, 2, 3]])
        assert torch.equal(out, w) if fmt.startswith("int4") else torch.allclose(out, w, rtol=1e-3)


@pytest.fixture(scope="module")
def real_weights(default_model_path: str) -> list[torch.Tensor]:
    """The first 128 rows of each projection of the default model's first layer, dequantized (rows are
    quantized independently)."""
    return [dequantize_tensor(t)[:128] for t in iter_gguf_raw_tensors(default_model_path)
            if t.name.startswith("model.layers.0.") and t.name.endswith("proj.weight")]


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_real_weights(real_weights: list[torch.Tensor], fmt: str) -> None:
    assert len(real_weights) == 7
    for w in real_weights:
        _bound_ok(w, QuantFormat.parse(fmt))


def test_int4_packing_layout() -> None:
    """Byte b*16 + j of a row: input b*32 + j in the low nibble, input b*32 + j + 16 in the high one; K is
    zero-padded to a multiple of 32."""
    q = torch.randint(0, 16, (3, 70), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (3, 48)
    padded = torch.nn.functional.pad(q, (0, 26))
    for b in range(3):
        for j in range(16):
            assert torch.equal(packed[:, b * 16 + j], padded[:, b * 32 + j] | (padded[:, b * 32 + j + 16] << 4))
    assert torch.equal(unpack_int4(packed, 70), q)


def test_parse_and_sizes() -> None:
    assert QuantFormat.parse("int8") == QuantFormat(8, None)
    assert QuantFormat.parse("int4") == QuantFormat(4, 128)
    assert QuantFormat.parse("int4", 32) == QuantFormat.parse("int4-g32") == QuantFormat(4, 32)
    assert QuantFormat.parse("fp8") == QuantFormat(8, None, fp8=True) and QuantFormat.parse("fp8").name == "fp8"
    for bad in ("int3", "fp4", "int4-g48", "fp8-g32"):
        with pytest.raises(ValueError):
            QuantFormat.parse(bad)
    with pytest.raises(ValueError):
        QuantFormat.parse("int4-g32", 64)
    assert QuantFormat(8, None).nbytes(10, 100) == 10 * 100 + 10 * 2
    assert QuantFormat(4, 32).nbytes(10, 100) == 10 * 64 + 10 * 4 * 4   # 100 -> 128 padded, 4 groups of (s, m)
    assert QuantFormat(8, fp8=True).nbytes(10, 100) == 10 * 100 + 10 * 4  # a float32 scale a row
    with pytest.raises(ValueError, match="group size"):
        QuantFormat.parse("fp8", 32)
    with pytest.raises(ValueError, match="FP8"):
        QuantFormat(8, 32, fp8=True)


def _fp8_bound_ok(w: torch.Tensor) -> None:
    """e4m3 keeps 3 mantissa bits: |error| <= |w| / 16 for normal values, half a subnormal step (s / 1024) below
    them; each row's largest |w| maps to 448 and comes back exactly (float32 rounding aside)."""
    qw = quantize(w, QuantFormat.parse("fp8"))
    assert qw.qweight.dtype == torch.float8_e4m3fn and qw.scales.dtype == torch.float32
    assert qw.scales.shape == (w.shape[0], 1)
    w = w.float()
    s = qw.scales.float()
    err = (qw.dequantize() - w).abs()
    assert bool((err <= torch.maximum(w.abs() / 16, s / 1024) * (1 + 1e-5) + 1e-12).all())
    amax = w.abs().amax(-1)
    assert torch.allclose(qw.dequantize().abs().amax(-1), amax, rtol=1e-6)
    assert bool((qw.qweight.float().abs().amax(-1)[amax > 0] == 448).all())


@pytest.mark.parametrize("shape", [(1, 1), (3, 31), (17, 100), (64, 576), (5, 1000)])
def test_fp8_round_trip_random(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 1e-3
    _fp8_bound_ok(w)


def test_fp8_round_trip_real_weights_and_zero_rows(real_weights: list[torch.Tensor]) -> None:
    for w in real_weights:
        _fp8_bound_ok(w)
    w = torch.zeros(3, 40)
    w[1] = 0.25
    out = quantize(w, QuantFormat.parse("fp8")).dequantize()
    assert torch.equal(out, w)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1])
def test_gguf_blocks_exact(qtype: QT) -> None:
    w = (np.random.default_rng(int(qtype)).standard_normal((48, 160)) * 0.05).astype(np.float32)
    data = gguf_quantize(w, qtype)
    qw = gguf_to_quantized(GGUFTensor("w", qtype, data, (48, 160)))
    assert qw.fmt.group_size == 32 and qw.fmt.bits == (8 if qtype == QT.Q8_0 else 4)
    assert np.array_equal(qw.dequantize().numpy(), dequantize(data, qtype).reshape(48, 160))


def test_gguf_default_model_exact(default_model_path: str) -> None:
    """The shipped Q4_1 projections and Q8_0 embedding, unpacked by us, equal gguf's dequantization bit for bit."""
    types = set()
    for t in iter_gguf_raw_tensors(default_model_path):
        if t.qtype in (QT.Q4_1, QT.Q8_0) and (t.name.startswith("model.layers.3.") or "embed" in t.name):
            assert np.array_equal(gguf_to_quantized(t).dequantize().numpy(), dequantize_tensor(t).numpy()), t.name
            types.add(t.qtype)
    assert types == {QT.Q4_1, QT.Q8_0}


def test_int4_g32_recovers_q4_1(default_model_path: str) -> None:
    """Quantizing the float values of Q4_1 blocks to INT4 g32 gives the blocks back, bit for bit."""
    for t in iter_gguf_raw_tensors(default_model_path):
        if t.name.startswith("model.layers.7.") and t.qtype == QT.Q4_1:
            shipped = gguf_to_quantized(t)
            again = quantize(shipped.dequantize(), QuantFormat(4, 32))
            assert torch.equal(again.qweight, shipped.qweight) and torch.equal(again.scales, shipped.scales)
            assert torch.equal(again.mins, shipped.mins)
