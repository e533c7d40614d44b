"""RMSNorm folded into the projection it feeds (CPU): the projection normalizing its own input gives the norm
followed by the projection, and a norm folds once, into float or FP8 projections only (FP8 also takes the
SiLU·mul before a down projection)."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import torch_ref
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
    norm.fold_into(proj)
    x_in, eps = norm.for_projection(x)
    assert norm.weight is None and x_in is x and eps == 1e-5
    got = proj(x_in, rms_eps=eps, residual=residual)
    error = (got.double() - want.double()).norm() / want.double().norm()
    assert error < (1e-6 if dtype == torch.float32 else 1e-2)  # bf16: the two round in different places


def test_fold_only_once_and_only_into_float_or_fp8_projections() -> None:
    norm, proj = _pair(torch.float32)
    quantized = to_quant_linear(proj, QuantFormat.parse("int8"), proj.weight.data)
    norm.fold_into(quantized)
    assert norm.weight is not None and not quantized.fold_silu_and_mul()  # INT8 takes neither
    with pytest.raises(ValueError, match="takes its output"):
        quantized(torch.randn(1, 96), rms_eps=1e-5)
    norm.fold_into(proj)
    with pytest.raises(ValueError, match="already folded"):
        norm.fold_into(proj)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_projection_folds_norm_and_silu_and_mul(dtype: torch.dtype) -> None:
    """FP8 normalizes (or applies SiLU·mul to) its input in its quantization: in float32 exactly the norm (SiLU·mul)
    and then the projection, since nothing is rounded between them; in bf16 the 16-bit rounding of the producer's
    output is skipped, so close."""
    x, residual = torch.randn(5, 96).to(dtype) * 3, torch.randn(5, 40).to(dtype)
    norm, proj = _pair(dtype)
    fp8 = to_quant_linear(proj, QuantFormat.parse("fp8"), proj.weight.data)
    want = fp8(norm(x), residual=residual)
    norm.fold_into(fp8)
    assert norm.weight is None
    got = fp8(*norm.for_projection(x)[:1], rms_eps=norm.eps, residual=residual)
    down = to_quant_linear(proj, QuantFormat.parse("fp8"), proj.weight.data)
    gate_up = torch.randn(5, 192).to(dtype) * 2
    want_down = down(torch_ref.silu_and_mul(gate_up))
    assert down.fold_silu_and_mul()
    got_down = down(gate_up)
    for g, w in ((got, want), (got_down, want_down)):
        assert g.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(g, w)
        else:
            assert (g.double() - w.double()).norm() / w.double().norm() < 3e-2
