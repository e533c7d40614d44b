"""The TMA-fed FP8 GEMM (triton_fp8_gemm.py) against the float64 twin (skipped without CUDA or before sm_90): rows
past one tile and not a multiple of it, N and K not multiples of the tiles, every split, bias and residual,
both accumulations."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("the TMA FP8 GEMM needs an sm_90+ CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from paged_cases import rel_err

from tokenmill.kernels import quant_ref, triton_fp8_gemm, triton_fp8_linear
from tokenmill.kernels.triton_fp8_gemm import Fp8GemmConfig
from tokenmill.quant.formats import QuantFormat, quantize

FP8 = QuantFormat.parse("fp8")
CONFIGS = [triton_fp8_gemm.DECODE_CFG, Fp8GemmConfig(128, 64, 128, num_warps=8, programs_per_sm=2),
           Fp8GemmConfig(64, 256, 128, num_stages=3, fast_accum=False),
           Fp8GemmConfig(64, 64, 256, num_stages=3, group_m=2)]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("m,n,k", [(65, 4096, 4096), (160, 1000, 1104), (256, 6144, 4096), (300, 4096, 14336)])
def test_fp8_gemm_matches_twin(cfg: Fp8GemmConfig, m: int, n: int, k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m + n + k + cfg.block_n)
    qw = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, FP8)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    residual = torch.randn(m, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    xq, xs = triton_fp8_linear.quantize_rows(x)
    assert triton_fp8_gemm.supports(xq, qw.qweight, torch.bfloat16)
    want = quant_ref.quant_linear(x, qw.qweight, qw.scales, None, k, k, bias.double(), residual=residual.double(),
                                  out_dtype=torch.float64)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    out.copy_(triton_fp8_gemm.fp8_gemm(xq, xs, qw.qweight, qw.scales, bias, residual, torch.bfloat16, cfg))
    assert not out.isnan().any() and rel_err(out, want) < 1e-2
    plain = triton_fp8_gemm.fp8_gemm(xq, xs, qw.qweight, qw.scales, None, None, torch.float16, cfg)
    want_plain = quant_ref.quant_linear(x, qw.qweight, qw.scales, None, k, k, None, out_dtype=torch.float64)
    assert plain.dtype == torch.float16 and rel_err(plain, want_plain) < 1e-2


def test_split_is_whole_tiles() -> None:
    """Every split but the last holds the same whole number of BLOCK_K tiles, and no split is empty."""
    cfg = Fp8GemmConfig(64, 128, 128)
    for m, n, k in ((65, 4096, 14336), (256, 4096, 4096), (1, 64, 16)):
        per = triton_fp8_gemm.split_tiles(m, n, k, cfg, 132)
        k_tiles = -(-k // cfg.block_k)
        splits = -(-k_tiles // per)
        assert 1 <= splits <= 16 and (splits - 1) * per < k_tiles <= splits * per
