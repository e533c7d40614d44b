"""The integer-dot INT4 GEMV (triton_int4_idot.py): its fixed point and twin (quant_ref) on any machine; on CUDA the kernel
against the twin (same fixed point, float64) and against the float64 product of the dequantized weight, over
groups 32/64/128, K not a multiple of the group or of a packing block, N not a multiple of the row tile, splits
and none, bias, residual and float32 output. Outputs come from torch.empty, NaN-filled in deterministic mode."""
from __future__ import annotations

import pytest
import torch

from paged_cases import rel_err

from tokenmill.kernels import quant_ref
from tokenmill.quant.formats import QuantFormat, quantize

CUDA = torch.cuda.is_available()


def _x(k: int, gen: torch.Generator, device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Normal x with a few outliers (up to 2,000 times the rest) and an all-zero block."""
    x = torch.randn(k, generator=gen, device=device)
    x[torch.randint(0, k, (max(1, k // 500),), generator=gen, device=device)] *= 2000.0
    x[32:64] = 0.0
    return x.to(dtype)


def test_fixed_point_is_exact_down_to_a_128th_of_the_block() -> None:
    gen = torch.Generator().manual_seed(0)
    x = _x(4100, gen)
    xq, d, sums = quant_ref.quantize_x(x)
    kb = d.numel()
    assert kb == 129 and xq.numel() == kb * 32
    xf = torch.nn.functional.pad(x.float(), (0, kb * 32 - x.numel())).view(kb, 32)
    amax = xf.abs().amax(1)
    mant, _ = torch.frexp(d)
    assert (mant == 0.5).all()  # powers of two
    assert (xq.abs() <= 32768).all()
    big = amax > 0
    assert ((amax[big] / d[big] >= 2**14) & (amax[big] / d[big] < 2**15)).all()
    back = xq.view(kb, 32).double() * d.double()[:, None]
    exact = xf.abs() >= amax[:, None] / 128
    assert torch.equal(back[exact], xf.double()[exact])
    assert ((back - xf.double()).abs() <= d.double()[:, None] / 2).all()
    assert torch.equal(sums, xf.sum(1))
    assert (xq.view(kb, 32)[1] == 0).all() and sums[1] == 0


@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g128"])
def test_twin_matches_the_dequantized_product(fmt: str) -> None:
    f = QuantFormat.parse(fmt)
    gen = torch.Generator().manual_seed(1)
    k = 1000
    qw = quantize(torch.randn(70, k, generator=gen) * 0.05, f)
    x = torch.randn(k, generator=gen).to(torch.bfloat16)
    plain = quant_ref.quant_linear(x.double(), qw.qweight, qw.scales, qw.mins, k, f.group(k), None)
    got = quant_ref.int4_idot_linear(x, qw.qweight, qw.scales, qw.mins, k, f.group(k), out_dtype=torch.float64)
    assert rel_err(got, plain) < 1e-5


gpu = pytest.mark.skipif(not CUDA, reason="Triton kernels need CUDA")
# (n, k): one short row tile; K past the last packing block and not a whole g128 group; Llama-3-8B's qkv, o,
# gate/up and down projections
SHAPES = [(16, 128), (37, 1000), (130, 4160), (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _configs():
    from tokenmill.kernels.triton_int4_idot import IdotConfig
    # the default; no split; a 4-way split of small tiles; long tiles; wide row tiles of 8 warps; loads after the wait
    return [None, IdotConfig(split_k=1), IdotConfig(block_n=32, blocks=4, split_k=4), IdotConfig(blocks=16),
            IdotConfig(block_n=128, num_warps=8), IdotConfig(early=False)]


@gpu
@pytest.mark.usefixtures("nan_filled_allocations")
@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "int4-g128"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_equals_twin(n: int, k: int, fmt: str) -> None:
    from tokenmill.kernels.triton_int4_idot import int4_idot_gemv, supports
    f = QuantFormat.parse(fmt)
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.05, f)
    x = _x(k, gen, "cuda")
    bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    residual = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert supports(x, qw.qweight, f.group(k))
    twin = quant_ref.int4_idot_linear(x, qw.qweight, qw.scales, qw.mins, k, f.group(k), out_dtype=torch.float64)
    plain = quant_ref.quant_linear(x.double(), qw.qweight, qw.scales, qw.mins, k, f.group(k), None)
    for cfg in _configs():
        got = int4_idot_gemv(x, qw.qweight, qw.scales, qw.mins, k, f.group(k), None, cfg, out_dtype=torch.float32)
        assert got.shape == (n,) and got.dtype == torch.float32
        assert rel_err(got, twin) < 1e-6, cfg
        got16 = int4_idot_gemv(x, qw.qweight, qw.scales, qw.mins, k, f.group(k), None, cfg)
        assert got16.dtype == torch.bfloat16 and rel_err(got16, plain) < 1e-2, cfg
    got = int4_idot_gemv(x.view(1, 1, k), qw.qweight, qw.scales, qw.mins, k, f.group(k), bias, residual=residual)
    assert got.shape == (1, 1, n)
    assert rel_err(got, twin + bias.double() + residual.double()) < 1e-2


@gpu
@pytest.mark.usefixtures("nan_filled_allocations")
def test_float16_x() -> None:
    from tokenmill.kernels.triton_int4_idot import int4_idot_gemv
    gen = torch.Generator(device="cuda").manual_seed(5)
    k, n = 4096, 1000
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.05, QuantFormat.parse("int4-g128"))
    x = _x(k, gen, "cuda", torch.float16)
    twin = quant_ref.int4_idot_linear(x, qw.qweight, qw.scales, qw.mins, k, 128, out_dtype=torch.float64)
    got = int4_idot_gemv(x, qw.qweight, qw.scales, qw.mins, k, 128, out_dtype=torch.float32)
    assert rel_err(got, twin) < 1e-6


@gpu
@pytest.mark.usefixtures("nan_filled_allocations")
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (4096, 14336), (300, 1000)])
def test_quant_linear_runs_one_bf16_row_on_it(n: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With TOKENMILL_INT4_IDOT=1 quant_linear's one-row INT4 path is this kernel (same bits), for 3-D x and a
    residual too."""
    from tokenmill.kernels import triton_int4_idot
    from tokenmill.kernels.triton_int4_idot import int4_idot_gemv
    from tokenmill.kernels.triton_quant import quant_linear
    monkeypatch.setattr(triton_int4_idot, "enabled", lambda: True)
    gen = torch.Generator(device="cuda").manual_seed(n)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.05, QuantFormat.parse("int4-g128"))
    x = torch.randn(1, 1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    residual = torch.randn(1, 1, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    got = quant_linear(x, qw.qweight, qw.scales, qw.mins, k, 128, None, residual=residual)
    want = int4_idot_gemv(x, qw.qweight, qw.scales, qw.mins, k, 128, None, residual=residual)
    assert got.shape == (1, 1, n) and torch.equal(got, want)


@gpu
@pytest.mark.parametrize("value,on", [("0", False), ("1", True), ("yes", None)])
def test_switch(value: str, on: bool | None, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.kernels import triton_int4_idot
    monkeypatch.setenv(triton_int4_idot.IDOT_ENV, value)
    triton_int4_idot.enabled.cache_clear()
    try:
        if on is None:
            with pytest.raises(ValueError, match="allowed: 0, 1"):
                triton_int4_idot.enabled()
        else:
            assert triton_int4_idot.enabled() is on
    finally:
        triton_int4_idot.enabled.cache_clear()
