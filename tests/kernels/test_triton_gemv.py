"""The batch-1 GEMV (triton_gemv.py) against a float64 reference (skipped without CUDA): float, INT8 and INT4
weights, odd N and K, K not a multiple of the tile or the group, every tile shape and split, the bit-trick and
converting dequantizations. Outputs come from torch.empty, NaN-filled in deterministic mode, so an output the
kernel never writes fails."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA", allow_module_level=True)
pytest.importorskip("triton")

from paged_cases import rel_err

from tokenmill.kernels import quant_ref, torch_ref, triton_ops
from tokenmill.kernels.triton_arrive import counters
from tokenmill.kernels.triton_gemv import (
    INT4,
    INT8,
    GemvConfig,
    default_config,
    dense_gemv,
    quant_gemv,
)
from tokenmill.kernels.triton_quant import quant_linear
from tokenmill.quant.formats import QuantFormat, quantize

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# "unit" dequantization sums products of weights offset near 1.0 and takes the offset's sum off per chunk: float32
# keeps about 17 of its 24 bits of each product for INT4 (1 + q / 128, 1 + q / 2048): ~3e-5 over many outputs, up to
# ~2e-4 for one output of a short dot; about 16 for INT8 (1 + (q + 128) / 2^15): one output of a 32-input dot that
# cancels to a few percent of its terms' size measured 1.1e-3 on the H200. float32 activations take the exact
# kernels by default.
UNIT_TOL = {4: {**TOL, torch.float32: 1e-3}, 8: {**TOL, torch.float32: 2e-3}}
# (4096, 4096): INT4's o-projection tile, loaded before the PDL wait; the last: INT4's wide-matrix tile
SHAPES = [(1, 32), (37, 1000), (130, 4160), (4096, 14336), (4096, 4096), (16411, 520)]
# The defaults, every dequantization, a split count given, splits computed, one and eight warps' worth of rows.
CONFIGS = [None, GemvConfig(4, 256, 1, dequant="bits"), GemvConfig(32, 1024, 3, num_warps=8, dequant="cvt"),
           GemvConfig(128, 256, 0, num_warps=8), GemvConfig(64, 256, 2, dequant="unit"),
           GemvConfig(256, 128, 0, num_warps=8, dequant="unit", ahead=2)]
FORMATS = ["int8", "int8-g32", "int4-g32", "int4-g64", "int4-g128"]
pytestmark = pytest.mark.usefixtures("nan_filled_allocations")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n,k", SHAPES)
def test_dense_gemv(n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=dtype)
    x = torch.randn(1, 1, k, device="cuda", generator=gen, dtype=dtype)
    bias = torch.randn(n, device="cuda", generator=gen, dtype=dtype)
    want = F.linear(x.double(), w.double(), bias.double())
    for cfg in CONFIGS:
        got = dense_gemv(x, w, bias, cfg)
        assert got.shape == (1, 1, n) and got.dtype == dtype
        assert rel_err(got, want) < TOL[dtype], cfg


# Each (format, dtype, config) compiles its own kernels (about 4 minutes for all of them on the H200), so
# float16, whose path is bfloat16's, runs two formats.
QUANT_CASES = ([(fmt, dtype) for fmt in FORMATS for dtype in (torch.bfloat16, torch.float32)]
               + [(fmt, torch.float16) for fmt in ("int8", "int4-g128")])


@pytest.mark.parametrize("fmt,dtype", QUANT_CASES, ids=str)
@pytest.mark.parametrize("n,k", SHAPES)
def test_quant_gemv(n: int, k: int, fmt: str, dtype: torch.dtype) -> None:
    f = QuantFormat.parse(fmt)
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.05, f)
    x = torch.randn(1, k, device="cuda", generator=gen, dtype=dtype)
    bias = torch.randn(n, device="cuda", generator=gen, dtype=dtype)
    want = quant_ref.quant_linear(x.double(), qw.qweight, qw.scales, qw.mins, k, f.group(k), bias.double())
    for cfg in CONFIGS:
        got = quant_gemv(x, qw.qweight, qw.scales, qw.mins, k, f.group(k), bias, cfg)
        assert got.shape == (1, n) and got.dtype == dtype
        mode = (cfg or default_config(INT4 if f.bits == 4 else INT8, n, k=k, dtype=dtype)).dequant
        unit = mode == "unit" and (f.bits == 4 or k % 16 == 0)  # INT8 rows of whole 16-byte blocks, else "bits"
        assert rel_err(got, want) < (UNIT_TOL[f.bits] if unit else TOL)[dtype], cfg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n,k", [(37, 1000), (6144, 4096), (4096, 14336)])
def test_dense_gemv_normalizes_adds_the_residual_and_casts(n: int, k: int, dtype: torch.dtype) -> None:
    """rms_eps: the input's RMS norm (sums of squares over K splits merged in order); residual: added before the
    one rounding; out_dtype: float32 logits straight from a 16-bit row."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=dtype)
    x = torch.randn(1, k, device="cuda", generator=gen, dtype=dtype) * 4
    residual = torch.randn(1, n, device="cuda", generator=gen, dtype=dtype) * 8
    bias = torch.randn(n, device="cuda", generator=gen, dtype=dtype)
    want = torch_ref.linear(x.double(), w.double(), bias.double(), rms_eps=1e-5, residual=residual.double())
    for cfg in (None, GemvConfig(8, 512, 1, dequant="cvt"), GemvConfig(16, 256, 5, dequant="cvt")):
        got = dense_gemv(x, w, bias, cfg, rms_eps=1e-5, residual=residual)
        assert got.dtype == dtype and rel_err(got, want) < TOL[dtype], cfg
        got = dense_gemv(x, w, None, cfg, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and rel_err(got, F.linear(x.double(), w.double())) < TOL[dtype], cfg


@pytest.mark.parametrize("fmt", ["int8", "int4-g128"])
@pytest.mark.parametrize("rows", [1, 5])
def test_quant_matmuls_add_the_residual(fmt: str, rows: int) -> None:
    """The residual add in the quantized GEMV's (one row) and tile kernel's (more rows) store."""
    f = QuantFormat.parse(fmt)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    qw = quantize(torch.randn(4096, 14336, device="cuda", generator=gen) * 0.05, f)
    x = torch.randn(rows, 14336, device="cuda", generator=gen, dtype=torch.bfloat16)
    residual = torch.randn(rows, 4096, device="cuda", generator=gen, dtype=torch.bfloat16) * 8
    want = quant_ref.quant_linear(x.double(), qw.qweight, qw.scales, qw.mins, 14336, f.group(14336), None,
                                  residual=residual.double())
    got = quant_linear(x, qw.qweight, qw.scales, qw.mins, 14336, f.group(14336), None, residual=residual)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < TOL[torch.bfloat16]


def test_split_k_leaves_its_counters_at_zero() -> None:
    """The split that finishes last adds the partial sums and resets its tile's counter: launches of other shapes
    and split counts after it, and the same launch again, all get the right answer."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    cases = [(torch.randn(n, k, device="cuda", generator=gen), torch.randn(1, k, device="cuda", generator=gen))
             for n, k in [(300, 4096), (37, 1000), (4096, 14336)]]
    for _ in range(2):
        for (w, x), split in zip(cases, (3, 8, 2)):
            got = dense_gemv(x, w, config=GemvConfig(16, 256, split, dequant="cvt"))
            assert rel_err(got, F.linear(x.double(), w.double())) < TOL[torch.float32]
    assert counters(x.device, 4096).count_nonzero() == 0


def test_linear_takes_the_gemv_for_one_16_bit_row() -> None:
    """ops.linear: one bf16 row is the GEMV's (bit for bit), two rows and float32 rows stay cuBLAS's."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(300, 1000, device="cuda", generator=gen, dtype=torch.bfloat16)
    x = torch.randn(2, 1000, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert torch.equal(triton_ops.linear(x[:1], w), dense_gemv(x[:1], w))
    assert torch.equal(triton_ops.linear(x, w), F.linear(x, w))
    assert torch.equal(triton_ops.linear(x[:1].float(), w.float()), F.linear(x[:1].float(), w.float()))


def test_linear_normalizes_adds_and_casts_beyond_one_row() -> None:
    """ops.linear with more rows: the norm kernel without a weight, cuBLAS adding the residual, then the cast."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(300, 1000, device="cuda", generator=gen, dtype=torch.bfloat16)
    x = torch.randn(5, 1000, device="cuda", generator=gen, dtype=torch.bfloat16) * 4
    residual = torch.randn(5, 300, device="cuda", generator=gen, dtype=torch.bfloat16) * 8
    want = torch_ref.linear(x.double(), w.double(), rms_eps=1e-5, residual=residual.double())
    got = triton_ops.linear(x, w, rms_eps=1e-5, residual=residual, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and rel_err(got, want) < TOL[torch.bfloat16]


def test_linear_writes_float32_logits_unrounded_beyond_one_row() -> None:
    """The LM head's call (float32 out, no bias or residual) keeps cuBLAS's float32 sums: closer to float64 than
    the twin's bf16 result converted, and not a multiple of bf16's steps."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    w = torch.randn(3000, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    x = torch.randn(2, 7, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    want = torch_ref.linear(x.double(), w.double())
    got = triton_ops.linear(x, w, out_dtype=torch.float32)
    rounded = torch_ref.linear(x, w, out_dtype=torch.float32)
    assert got.shape == (2, 7, 3000) and got.dtype == torch.float32
    assert rel_err(got, want) < rel_err(rounded, want) / 10


def test_strided_inputs() -> None:
    """A column of a wider activation and a transposed weight view give the contiguous answer."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    wide = torch.randn(1, 2000, device="cuda", generator=gen)
    w_t = torch.randn(1000, 300, device="cuda", generator=gen)
    x, w = wide[:, ::2], w_t.t()
    assert rel_err(dense_gemv(x, w), F.linear(x.double(), w.double())) < TOL[torch.float32]


@pytest.mark.parametrize("kwargs", [dict(block_n=4, block_k=16), dict(block_n=3, block_k=64),
                                    dict(block_n=4, block_k=64, dequant="fast"),
                                    dict(block_n=4, block_k=64, ahead=3)])
def test_bad_config_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="GemvConfig"):
        GemvConfig(**kwargs)
