"""Programmatic dependent launch (triton_pdl.py), GPU only: a chain of kernels that each read the previous
kernel's output gives, captured in a CUDA graph with PDL, exactly what it gives launched eagerly without PDL. A
kernel that touched its input before waiting would read the last replay's values or the NaN its buffer was
allocated with."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA", allow_module_level=True)
pytest.importorskip("triton")

from paged_cases import make_case

from tokenmill.kernels import triton_pdl
from tokenmill.kernels.triton_activation import silu_and_mul
from tokenmill.kernels.triton_attention import decode_attention_rope
from tokenmill.kernels.triton_gemv import GemvConfig, dense_gemv
from tokenmill.kernels.triton_norm import rms_norm

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 512, 1536, 8, 2, 64
pytestmark = pytest.mark.usefixtures("nan_filled_allocations")


def _layer(x: torch.Tensor, w: dict[str, torch.Tensor], case, cos_sin: torch.Tensor,
           slot: torch.Tensor) -> torch.Tensor:
    """One decoder layer at batch 1, every op a Triton kernel of the decode path, the split GEMV included: the
    first norm a kernel of its own, the second folded into the gate/up GEMV, decode attention with its rotary and
    cache write (reading the cache before its wait: EARLY), the residual adds in the o and down GEMVs."""
    h = rms_norm(x, w["norm"], 1e-6)
    qkv = dense_gemv(h, w["qkv"])
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    o = decode_attention_rope(case.seq_lens.long() - 1, q.view(1, HEADS, HEAD_DIM), k.view(1, KV_HEADS, HEAD_DIM),
                              v.view(1, KV_HEADS, HEAD_DIM), cos_sin, case.k_cache, case.v_cache, slot,
                              case.seq_lens, case.block_tables, case.scale)
    x = dense_gemv(o.view(1, -1), w["o"], config=GemvConfig(8, 64, split_k=4), residual=x)
    up = dense_gemv(x, w["gate_up"], config=GemvConfig(8, 64, split_k=4), rms_eps=1e-6)
    return dense_gemv(silu_and_mul(up), w["down"], residual=x)


def test_kernel_chain_in_a_graph_with_pdl_equals_eager_without(monkeypatch) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)

    w = {"norm": rand(HIDDEN) + 1, "qkv": rand((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
         "o": rand(HIDDEN, HEADS * HEAD_DIM), "gate_up": rand(2 * FFN, HIDDEN), "down": rand(HIDDEN, FFN)}
    case = make_case([300], [1], HEADS, KV_HEADS, HEAD_DIM, 16, torch.bfloat16, "cuda", table_width=64)
    slot = case.block_tables[0, 299 // 16].long().view(1) * 16 + 299 % 16
    cos_sin = torch.randn(512, HEAD_DIM, device="cuda")
    inputs = [rand(1, HIDDEN) * 30 for _ in range(4)]

    def run_eager(x: torch.Tensor) -> torch.Tensor:
        return _layer(_layer(x, w, case, cos_sin, slot), w, case, cos_sin, slot)

    monkeypatch.setenv(triton_pdl.PDL_ENV, "0")
    triton_pdl.pdl_enabled.cache_clear()
    want = [run_eager(x).clone() for x in inputs]
    assert all(torch.isfinite(y).all() for y in want)

    monkeypatch.setenv(triton_pdl.PDL_ENV, "1")
    triton_pdl.pdl_enabled.cache_clear()
    if not triton_pdl.pdl_enabled(0):
        pytest.skip("PDL needs compute capability 9.0")
    static_x = inputs[0].clone()
    run_eager(static_x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = run_eager(static_x)
    for _ in range(3):
        for x, y in zip(inputs, want):
            static_x.copy_(x)
            graph.replay()
            assert torch.equal(static_y, y)
    triton_pdl.pdl_enabled.cache_clear()


def test_bad_pdl_setting_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(triton_pdl.PDL_ENV, "yes")
    triton_pdl.pdl_enabled.cache_clear()
    with pytest.raises(ValueError, match="TOKENMILL_PDL='yes' is not supported; allowed: 0, 1"):
        triton_pdl.pdl_enabled(0)
    triton_pdl.pdl_enabled.cache_clear()
