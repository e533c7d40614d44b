"""The tensor-core INT4 decode matmul (triton_int4_mma.py) against a float64 reference (skipped without CUDA):
1 to 16 rows (one and two column tiles), groups 32/64/128, K not a multiple of the group or of a packing block,
N not a multiple of the row tile, bias and residual, with and without a K split, weights loaded to registers or
(sm_90+) copied by TMA through a ring in shared memory; SiLU·mul in the store against the product and the
SiLU·mul kernel. Outputs come from torch.empty, NaN-filled in deterministic mode, so an output the kernel never
writes fails."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA", allow_module_level=True)
pytest.importorskip("triton")

from paged_cases import rel_err

from tokenmill.kernels import quant_ref, torch_ref
from tokenmill.kernels.triton_activation import silu_and_mul
from tokenmill.kernels.triton_int4_mma import (ROW_DEEP_TMA_CFG, ROW_TALL_TMA_CFG, ROW_VOCAB_TMA_CFG, ROW_WIDE_TMA_CFG,
                                               MmaGemvConfig, default_config, has_tma, int4_mma_gemv, supports)
from tokenmill.kernels.triton_quant import quant_linear
from tokenmill.quant.formats import QuantFormat, quantize

pytestmark = pytest.mark.usefixtures("nan_filled_allocations")
# (n, k): one tile's rows; K past the last packing block; K a whole number of g32/g64 groups but not g128;
# Llama-3-8B's o and down projections
SHAPES = [(16, 128), (37, 1000), (130, 4160), (4096, 4096), (4096, 14336)]
# the default; one split (no partials); a 4-way split with 8 warps of one tile; 4 tiles a warp
CONFIGS = [None, MmaGemvConfig(split_k=1), MmaGemvConfig(tiles=1, num_warps=8, split_k=4),
           MmaGemvConfig(tiles=4, num_warps=4, programs_per_sm=2)]
TMA = torch.cuda.get_device_capability()[0] >= 9
if TMA:  # the one-row defaults for wide, deep, tall and vocabulary-sized matrices; a 2-stage ring that wraps many
    # times within a split
    CONFIGS += [ROW_WIDE_TMA_CFG, ROW_DEEP_TMA_CFG, ROW_TALL_TMA_CFG, ROW_VOCAB_TMA_CFG,
                MmaGemvConfig(tiles=1, num_warps=4, split_k=4, stages=2)]


@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "int4-g128"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 12, 16])
def test_int4_mma_gemv(m: int, n: int, k: int, fmt: str) -> None:
    f = QuantFormat.parse(fmt)
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.05, f)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    residual = torch.randn(m, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert supports(x, qw.qweight, f.group(k), k)
    plain = quant_ref.quant_linear(x.double(), qw.qweight, qw.scales, qw.mins, k, f.group(k), None)
    for cfg in CONFIGS:
        got = int4_mma_gemv(x, qw.qweight, qw.scales, qw.mins, k, f.group(k), None, cfg)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        assert rel_err(got, plain) < 1e-2, cfg
    got = int4_mma_gemv(x, qw.qweight, qw.scales, qw.mins, k, f.group(k), bias, residual=residual)
    assert rel_err(got, plain + bias.double() + residual.double()) < 1e-2


@pytest.mark.skipif(not TMA, reason="TMA needs sm_90+")
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("n,k,fmt", [(300, 4104, "int4-g64"), (4096, 4096, "int4-g128"), (64, 256, "int4-g32")])
def test_tma_ring_equals_register_loads(m: int, n: int, k: int, fmt: str) -> None:
    """The TMA ring changes where the weights travel and which thread holds which row, not a row's sums: the
    same tiles and split give the same bits (splits given: by default a ring rounds its split down to stay in one
    wave, the register-fed kernel rounds up)."""
    f = QuantFormat.parse(fmt)
    gen = torch.Generator(device="cuda").manual_seed(m + n)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.05, f)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert has_tma(qw.qweight)
    for cfg in (MmaGemvConfig(tiles=2, num_warps=2, split_k=7, stages=4),
                MmaGemvConfig(tiles=1, num_warps=2, split_k=1, stages=4),
                MmaGemvConfig(tiles=4, num_warps=4, split_k=3, stages=3)):
        args = (x, qw.qweight, qw.scales, qw.mins, k, f.group(k), None)
        assert torch.equal(int4_mma_gemv(*args, cfg), int4_mma_gemv(*args, MmaGemvConfig(
            tiles=cfg.tiles, num_warps=cfg.num_warps, programs_per_sm=cfg.programs_per_sm, split_k=cfg.split_k)))


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("half,k,fmt", [(16, 128, "int4-g32"), (37, 1000, "int4-g64"), (130, 4160, "int4-g128"),
                                        (1536, 576, "int4-g32"), (14336, 4096, "int4-g128")])
def test_silu_and_mul_out(m: int, half: int, k: int, fmt: str) -> None:
    """SiLU·mul in the store (gate rows and the up rows `half` further in one program) writes the very bits of the
    product followed by the SiLU·mul kernel, for every config (splits, tiles, the TMA ring's two copies a
    stage), with and without a bias; and stays within bf16 rounding of float64."""
    f = QuantFormat.parse(fmt)
    gen = torch.Generator(device="cuda").manual_seed(half + k + m)
    qw = quantize(torch.randn(2 * half, k, device="cuda", generator=gen) * 0.05, f)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    bias = torch.randn(2 * half, device="cuda", generator=gen, dtype=torch.bfloat16)
    args = (x, qw.qweight, qw.scales, qw.mins, k, f.group(k))
    for b in (None, bias):
        want = torch_ref.silu_and_mul(quant_ref.quant_linear(x.double(), *args[1:], None if b is None else b.double()))
        for cfg in CONFIGS:
            got = int4_mma_gemv(*args, b, cfg, silu_and_mul_out=True)
            assert got.shape == (m, half) and got.dtype == torch.bfloat16
            assert torch.equal(got, silu_and_mul(int4_mma_gemv(*args, b, cfg))), cfg
            assert rel_err(got, want) < 2e-2, cfg


def test_silu_and_mul_out_routes() -> None:
    """quant_linear's silu_and_mul_out: the fused store where the tensor-core kernel takes the call, the SiLU·mul
    kernel after the GEMV (a row of a small matrix) or the tile kernel (17 rows) elsewhere; the same values as
    the product then the kernel. A residual is refused."""
    f = QuantFormat.parse("int4-g128")
    gen = torch.Generator(device="cuda").manual_seed(3)
    for m, half, k in ((1, 14336, 4096), (4, 512, 1024), (1, 96, 256), (17, 512, 1024)):
        qw = quantize(torch.randn(2 * half, k, device="cuda", generator=gen) * 0.05, f)
        x = torch.randn(m, 1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        args = (qw.qweight, qw.scales, qw.mins, k, 128, None)
        got = quant_linear(x, *args, silu_and_mul_out=True)
        assert got.shape == (m, 1, half)
        assert torch.equal(got, silu_and_mul(quant_linear(x, *args))), (m, half, k)
    with pytest.raises(ValueError, match="no residual"):
        quant_linear(x, *args, residual=torch.zeros(m, 1, 2 * half, device="cuda", dtype=torch.bfloat16),
                     silu_and_mul_out=True)


@pytest.mark.parametrize("n,k,tma_cfg", [(16384, 1024, ROW_WIDE_TMA_CFG), (2048, 8192, ROW_DEEP_TMA_CFG),
                                         (6144, 4096, ROW_TALL_TMA_CFG), (65600, 512, ROW_VOCAB_TMA_CFG)])
def test_one_row_defaults(n: int, k: int, tma_cfg: MmaGemvConfig) -> None:
    """A single row of a matrix wide, deep, tall or vocabulary-sized enough for a one-row default (a TMA ring on
    sm_90+) through quant_linear, with a residual, against float64."""
    f = QuantFormat.parse("int4-g128")
    gen = torch.Generator(device="cuda").manual_seed(1)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.05, f)
    assert (default_config(1, n, k, has_tma(qw.qweight)) == tma_cfg) == TMA
    x = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    residual = torch.randn(1, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    args = (qw.qweight, qw.scales, qw.mins, k, 128, None)
    got = quant_linear(x, *args, residual=residual)
    assert rel_err(got, quant_ref.quant_linear(x.double(), *args, residual=residual.double())) < 1e-2


def test_rows_are_independent() -> None:
    """Through quant_linear, with 3-D x and a residual: a row's result does not depend on how many other rows
    share the call, from 2 to 16 (each is its own column of the mma, under one config)."""
    f = QuantFormat.parse("int4-g128")
    gen = torch.Generator(device="cuda").manual_seed(0)
    qw = quantize(torch.randn(512, 2048, device="cuda", generator=gen) * 0.05, f)
    x = torch.randn(16, 1, 2048, device="cuda", generator=gen, dtype=torch.bfloat16)
    residual = torch.randn(16, 1, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    args = (qw.qweight, qw.scales, qw.mins, 2048, 128, None)
    batch = quant_linear(x, *args, residual=residual)
    assert batch.shape == (16, 1, 512)
    want = quant_ref.quant_linear(x.double(), *args, residual=residual.double())
    assert rel_err(batch, want) < 1e-2
    for rows in ((0, 2), (5, 8), (7, 9), (8, 12), (14, 16)):
        part = quant_linear(x[rows[0]:rows[1]], *args, residual=residual[rows[0]:rows[1]])
        assert torch.equal(part, batch[rows[0]:rows[1]])


def test_supports() -> None:
    x = torch.zeros(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(16, 2048, device="cuda", dtype=torch.uint8)
    assert supports(x, w, 128, 4096)
    assert supports(torch.zeros(16, 4096, device="cuda", dtype=torch.bfloat16), w, 128, 4096)
    assert not supports(torch.zeros(17, 4096, device="cuda", dtype=torch.bfloat16), w, 128, 4096)  # 2 x 8 columns
    assert not supports(torch.zeros(0, 4096, device="cuda", dtype=torch.bfloat16), w, 128, 4096)  # nothing to do
    assert not supports(x.half(), w, 128, 4096)  # the mma multiplies bf16
    assert not supports(x.float(), w, 128, 4096)
    assert not supports(torch.zeros(1, 4100, device="cuda", dtype=torch.bfloat16), w, 128, 4100)  # K % 8
    assert not supports(torch.zeros(1, 4097, device="cuda", dtype=torch.bfloat16)[:, 1:], w, 128, 4096)  # x's words
    assert has_tma(w) == TMA
    assert not has_tma(torch.zeros(16, 2064, device="cuda", dtype=torch.uint8)[:, 8:])  # the base misaligned
    scales = torch.ones(16, 32, device="cuda", dtype=torch.float16)
    misaligned = torch.zeros(16 * 2048 + 4, device="cuda", dtype=torch.uint8)[4:].view(16, 2048)  # 4-byte aligned
    assert supports(x, misaligned, 128, 4096) and not has_tma(misaligned)
    with pytest.raises(ValueError, match="TMA"):
        int4_mma_gemv(x, misaligned, scales, scales, 4096, 128, None, ROW_WIDE_TMA_CFG)
    if TMA:
        with pytest.raises(ValueError, match="at most 256 rows"):
            int4_mma_gemv(x, w, scales, scales, 4096, 128, None, MmaGemvConfig(tiles=4, num_warps=8, stages=2))
