"""`tokenmill bench variants` end to end on the CPU (tiny-llama, random weights): a module swapped for a copy
keeps the tree's tokens, one swapped for a changed copy does not, a git revision loads, and every swap is undone."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenmill.bench.common import build_engine, generate
from tokenmill.bench.variants import parse_variant, swapped, load_variant_module
from tokenmill.cli import main
from tokenmill.config import EngineArgs
from tokenmill.kernels import torch_ref
from tokenmill.sampling_params import SamplingParams

TINY = ["--load-format", "dummy", "--model-preset", "tiny-llama"]
TORCH_REF = Path(torch_ref.__file__)
# a changed MLP (a zero one kept the greedy text of the tiny random model)
BIG_MLP = "\n\ndef silu_and_mul(x):\n    return 1e3 * x[..., x.shape[-1] // 2:]\n"


def test_variants_against_the_tree(tmp_path):
    (tmp_path / "same.py").write_text(TORCH_REF.read_text())
    (tmp_path / "big.py").write_text(TORCH_REF.read_text() + BIG_MLP)
    out = tmp_path / "result.json"
    main(["bench", "variants", *TINY, "--output-len", "4", "--num-iters", "1", "--rounds", "2", "--check-tokens", "8",
          "--variant", f"same:tokenmill.kernels.torch_ref:{tmp_path / 'same.py'}",
          "--variant", f"big:tokenmill.kernels.torch_ref:{tmp_path / 'big.py'}",
          "--variant", "head:tokenmill.kernels.torch_ref:git:HEAD", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["results"]}
    assert list(rows) == ["tree", "same", "big", "head"]
    assert [rows[v]["same_tokens"] for v in rows] == [True, True, False, True]
    assert all(len(r["tokens_per_s_all"]) == 2 and r["tokens_per_s"] > 0 for r in rows.values())
    assert result["engine_args"]["enable_prefix_caching"] is False  # a cached prompt would run other kernels


def test_swap_reaches_module_globals_and_layer_ops_and_is_undone(tmp_path):
    (tmp_path / "big.py").write_text(TORCH_REF.read_text() + BIG_MLP)
    big = load_variant_module("tokenmill.kernels.torch_ref", str(tmp_path / "big.py"), tmp_path)
    engine = build_engine(EngineArgs(load_format="dummy", model_preset="tiny-llama"))
    model = engine.runner.model
    mlp = model.model.layers[0].mlp
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    text = lambda: generate(engine, [[5, 9, 13, 7]], params)[0].outputs[0].token_ids  # noqa: E731
    before = text()
    x = torch.randn(2, mlp.gate_up_proj.in_features)
    with swapped({"tokenmill.kernels.torch_ref": big}, model):
        assert mlp.gate_up_proj.ops.silu_and_mul is big.silu_and_mul
        assert torch.equal(mlp.gate_up_proj.silu_and_mul(x), 1e3 * mlp.gate_up_proj(x).chunk(2, dim=-1)[1])
        assert text() != before
    assert mlp.gate_up_proj.ops.silu_and_mul is torch_ref.silu_and_mul
    assert text() == before


@pytest.mark.parametrize("spec,match", [
    ("tree:tokenmill.kernels.torch_ref:x.py", "NAME not 'tree'"),
    ("v:torch.nn:x.py", "MODULE a tokenmill module"),
    ("v:tokenmill.kernels.torch_ref", "expected NAME:MODULE:PATH"),
])
def test_bad_variant_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_variant(spec)


def test_missing_file_and_bad_revision(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_variant_module("tokenmill.kernels.torch_ref", str(tmp_path / "none.py"), tmp_path)
    with pytest.raises(ValueError, match="git show no-such-rev"):
        load_variant_module("tokenmill.kernels.torch_ref", "git:no-such-rev", tmp_path)


def test_shared_values_and_other_names_are_not_rebound(tmp_path, monkeypatch):
    """A None (or number, or string) the variant changes, and an object held under another name, keep the tree's
    binding: the identity of an interned value says nothing about where it came from."""
    monkeypatch.setattr(torch_ref, "_VARIANT_TEST", None, raising=False)
    (tmp_path / "v.py").write_text(TORCH_REF.read_text() + "\n\n_VARIANT_TEST = 'changed'\n")
    variant = load_variant_module("tokenmill.kernels.torch_ref", str(tmp_path / "v.py"), tmp_path)
    engine = build_engine(EngineArgs(load_format="dummy", model_preset="tiny-llama"))
    ops = engine.runner.model.model.layers[0].mlp.gate_up_proj.ops
    ops._VARIANT_TEST = None
    ops.other_name = torch_ref.silu_and_mul
    with swapped({"tokenmill.kernels.torch_ref": variant}, engine.runner.model):
        assert ops.silu_and_mul is variant.silu_and_mul
        assert ops._VARIANT_TEST is None and ops.other_name is torch_ref.silu_and_mul
