"""RMSNorm folded into the projection it feeds (CPU): the projection normalizing its own input gives the norm
followed by the projection, and a norm folds once, into float weights only."""
from __future__ import annotations

import pytest
import torch

from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import Linear
from tokenmill.quant.formats import QuantFormat
from tokenmill.quant.linear import to_quant_linear


def _pair(dtype: torch.dtype) -> tuple[RMSNorm, Linear]:
    gen = torch.Generator().manual_seed(0)
    norm, proj = RMSNorm(96, eps=1e-5), Linear(96, 40, bias=True)
    norm.weight.data = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    proj.weight.data = torch.randn(40, 96, generator=gen).to(dtype)
    proj.bias.data = torch.randn(40, generator=gen).to(dtype)
    return norm, proj


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_folded_norm_gives_norm_then_projection(dtype: torch.dtype) -> None:
    x, residual = torch.randn(5, 96).to(dtype) * 3, torch.randn(5, 40).to(dtype)
    norm, proj = _pair(dtype)
    x_in, eps = norm.for_projection(x)
    assert x_in is not x and eps is None
    want = proj(x_in, residual=residual)
    norm.fold_into(proj.weight.data)
    x_in, eps = norm.for_projection(x)
    assert norm.weight is None and x_in is x and eps == 1e-5
    got = proj(x_in, rms_eps=eps, residual=residual)
    error = (got.double() - want.double()).norm() / want.double().norm()
    assert error < (1e-6 if dtype == torch.float32 else 1e-2)  # bf16: the two round in different places


def test_fold_only_once_and_only_into_float_weights() -> None:
    norm, proj = _pair(torch.float32)
    quantized = to_quant_linear(proj, QuantFormat.parse("int8"), proj.weight.data)
    with pytest.raises(ValueError, match="float weight"):
        norm.fold_into(quantized.weight.data)
    with pytest.raises(ValueError, match="takes its output"):
        quantized(torch.randn(1, 96), rms_eps=1e-5)
    norm.fold_into(proj.weight.data)
    with pytest.raises(ValueError, match="already folded"):
        norm.fold_into(proj.weight.data)
