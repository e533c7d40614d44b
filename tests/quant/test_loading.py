"""Quantization at load: GGUF blocks kept as they are, float checkpoints quantized on arrival, and
`tokenmill quantize` folders that load back bit for bit (tokenizer and mixed-precision plan included)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill.model.loader import load_model, load_model_config
from tokenmill.quant.corpus import WindowRunner
from tokenmill.quant.formats import QuantFormat
from tokenmill.quant.linear import QuantLinear, QuantLMHead
from tokenmill.quant.loading import linear_modules, quantizable_modules, quantize_model
from tokenmill.quant.quantize import quantize_checkpoint

CPU = torch.device("cpu")
IDS = list(range(1000, 1040))


def _logprobs(model: torch.nn.Module) -> torch.Tensor:
    return WindowRunner(model, len(IDS), CPU, torch.float32).logprobs(IDS)


def test_gguf_native_equals_dequantized(default_model_path: str) -> None:
    """quantization='gguf' keeps the Q4_1 blocks (INT4 g32) and computes what the dequantized model does."""
    config = load_model_config(default_model_path)
    native = load_model(config, default_model_path, quantization="gguf")
    projections = linear_modules(native)
    assert len(projections) == 4 * config.num_hidden_layers
    assert all(isinstance(m, QuantLinear) and m.fmt == QuantFormat(4, 32) for m in projections.values())
    dense = load_model(config, default_model_path)
    assert torch.allclose(_logprobs(native), _logprobs(dense), atol=1e-4)


def test_quantization_errors(tiny_model_dir: str, default_model_path: str) -> None:
    config = load_model_config(tiny_model_dir)
    with pytest.raises(ValueError, match="not a GGUF"):
        load_model(config, tiny_model_dir, quantization="gguf")
    # the allowed values left out gguf, which the engine takes
    with pytest.raises(ValueError, match=r"'int5' is not supported; allowed: int8, .*, fp8, or gguf"):
        load_model(config, tiny_model_dir, quantization="int5")


@pytest.mark.parametrize("method", ["int8", "int4-g32", "fp8"])
def test_quantize_at_load_equals_quantizing_after(tiny_model_dir: str, method: str) -> None:
    config = load_model_config(tiny_model_dir)
    at_load = load_model(config, tiny_model_dir, quantization=method, fold_norms=True)  # FP8 folds, to the same float32 values
    after = load_model(config, tiny_model_dir)
    quantize_model(after, dict.fromkeys(linear_modules(after), QuantFormat.parse(method)))
    assert torch.equal(_logprobs(at_load), _logprobs(after))
    dummy = load_model(config, None, "dummy", quantization=method)
    assert all(isinstance(m, QuantLinear) for m in linear_modules(dummy).values())


def test_quantize_checkpoint_round_trip(tiny_model_dir: str, tmp_path) -> None:
    """Save INT4 (g64: 96 inputs leave a partial group) with one projection kept in float; the folder loads
    with its own quantization_config, bit for bit, and LLM generates from it with the exported tokenizer."""
    from tokenmill import LLM, SamplingParams
    skip = "model.layers.1.mlp.down_proj"
    out = quantize_checkpoint(tiny_model_dir, QuantFormat.parse("int4-g64"), str(tmp_path / "q"), skip=[skip],
                              calibration="rtn", dtype="float16", device="cpu")
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc == {"quant_method": "tokenmill", "method": "int4", "group_size": 64, "modules_to_not_convert": [skip],
                  "lm_head": False}
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))

    config = load_model_config(tiny_model_dir)
    want = load_model(config, tiny_model_dir)
    quantize_model(want, {n: QuantFormat.parse("int4-g64") for n in linear_modules(want) if n != skip})
    for p in want.parameters():   # what the folder holds: the unquantized tensors in float16
        if p.is_floating_point():
            p.data = p.data.half().float()
    got = load_model(load_model_config(out), out)
    modules = linear_modules(got)
    assert not isinstance(modules[skip], QuantLinear) and isinstance(modules["model.layers.0.mlp.down_proj"], QuantLinear)
    assert torch.allclose(_logprobs(got), _logprobs(want), atol=1e-5)
    with pytest.raises(ValueError, match="already quantized"):
        load_model(load_model_config(out), out, quantization="int8")
    llm = LLM(out, kv_cache_memory=8 << 20)
    assert len(llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("method", ["int8", "int4-g32", "fp8"])
def test_quantized_lm_head(tiny_model_dir: str, tmp_path, method: str, tied: bool) -> None:
    """quantize_lm_head: the head becomes a QuantLMHead (a tied one a quantized copy of the embedding, which
    stays float), loading equals quantizing the float model's head afterwards, and the logits are what the
    dequantized head gives."""
    from quant_helpers import tiny_config, write_tiny_checkpoint

    from tokenmill.kernels.quant_ref import quant_linear
    path = tiny_model_dir if tied else write_tiny_checkpoint(str(tmp_path), tiny_model_dir,
                                                             tiny_config(tie_word_embeddings=False))
    config = load_model_config(path)
    fmt = QuantFormat.parse(method)
    got = load_model(config, path, quantization=method, quantize_lm_head=True)
    head = got.lm_head
    assert isinstance(head, QuantLMHead) and head.fmt == fmt and "lm_head" in linear_modules(got)
    assert not isinstance(got.model.embed_tokens, QuantLinear) and got.model.embed_tokens.weight.dtype == torch.float32
    want = load_model(config, path)
    float_head = want.lm_head.weight.data.clone()
    quantize_model(want, dict.fromkeys(quantizable_modules(want, lm_head=True), fmt))
    assert torch.equal(_logprobs(got), _logprobs(want))
    hidden = torch.randn(3, config.hidden_size)
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, config.vocab_size)
    assert torch.allclose(logits, quant_linear(hidden, head.weight, head.weight_scale, head.weight_min,
                                               config.hidden_size, head.group, None), atol=1e-4)
    exact = hidden @ float_head.T  # the rounding error stays within the format's: ~0.9% (INT8), ~12% (INT4)
    assert (logits - exact).norm() / exact.norm() < {"int8": 0.02, "fp8": 0.06}.get(method, 0.15)
    dummy = load_model(config, None, "dummy", quantization=method, quantize_lm_head=True)
    dummy_after = load_model(config, None, "dummy")
    quantize_model(dummy_after, dict.fromkeys(quantizable_modules(dummy_after, lm_head=True), fmt))
    assert isinstance(dummy.lm_head, QuantLMHead) and torch.equal(_logprobs(dummy), _logprobs(dummy_after))


def test_tied_head_ignores_a_stored_lm_head_weight(tiny_model_dir: str, tmp_path) -> None:
    """A tied config whose file also holds a (different) lm_head.weight: the head is the embedding, float or
    quantized at load, as transformers ties it."""
    stray = str(tmp_path / "stray")
    shutil.copytree(tiny_model_dir, stray)
    tensors = load_file(os.path.join(stray, "model.safetensors"))
    assert "lm_head.weight" not in tensors
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = torch.randn_like(embedding)
    save_file(tensors, os.path.join(stray, "model.safetensors"))
    config = load_model_config(stray)
    assert config.tie_word_embeddings
    for kw in ({}, dict(quantization="int8", quantize_lm_head=True)):
        got, want = load_model(config, stray, **kw), load_model(config, tiny_model_dir, **kw)
        assert torch.equal(_logprobs(got), _logprobs(want)), kw


def test_quantized_lm_head_errors(tiny_model_dir: str, default_model_path: str, tmp_path) -> None:
    config = load_model_config(tiny_model_dir)
    for quantization in (None, "gguf"):
        with pytest.raises(ValueError, match="quantize_lm_head quantizes the LM head with weights quantized at load"):
            load_model(config, tiny_model_dir if quantization is None else default_model_path,
                       quantization=quantization, quantize_lm_head=True)
    out = quantize_checkpoint(tiny_model_dir, QuantFormat.parse("int8"), str(tmp_path / "q"), calibration="rtn",
                              dtype="float16", device="cpu")
    with pytest.raises(ValueError, match="keeps its LM head as stored"):
        load_model(load_model_config(out), out, quantize_lm_head=True)


def test_quantize_checkpoint_with_lm_head(tiny_model_dir: str, tmp_path) -> None:
    """A tied model saved with its head quantized: the folder says so, keeps the embedding in 16-bit, and loads
    back as the model quantized in memory (GPTQ-calibrated head included), bit for bit."""
    from tokenmill.quant.quantize import apply_weights, quantize_weights
    from tokenmill.tokenizer import load_tokenizer
    fmt = QuantFormat.parse("int4-g32")
    out = quantize_checkpoint(tiny_model_dir, fmt, str(tmp_path / "q"), calibration="gptq", calibration_tokens=256,
                              dtype="float16", device="cpu", quantize_lm_head=True)
    with open(os.path.join(out, "config.json")) as f:
        hf = json.load(f)
    assert hf["quantization_config"]["lm_head"] is True and hf["tie_word_embeddings"] is True
    config = load_model_config(tiny_model_dir)
    want = load_model(config, tiny_model_dir)
    apply_weights(want, quantize_weights(want, fmt, "gptq", load_tokenizer(tiny_model_dir), 256, lm_head=True))
    for p in want.parameters():   # what the folder holds: the unquantized tensors in float16
        if p.is_floating_point():
            p.data = p.data.half().float()
    got = load_model(load_model_config(out), out)
    assert isinstance(got.lm_head, QuantLMHead) and got.lm_head.fmt == fmt
    assert got.model.embed_tokens.weight is not got.lm_head.weight
    for name in ("weight", "weight_scale", "weight_min"):
        assert torch.equal(getattr(got.lm_head, name), getattr(want.lm_head, name)), name
    assert torch.allclose(_logprobs(got), _logprobs(want), atol=1e-5)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_engine_with_quantized_weights_and_kv(tiny_model_dir: str, kv: str) -> None:
    """Paged attention over small blocks, prefix caching, batching and n > 1 with INT4 weights and a
    quantized KV cache: a cached prefix or a batch neighbour changes no greedy token."""
    from tokenmill import LLM, SamplingParams
    llm = LLM(tiny_model_dir, quantization="int4-g32", kv_cache_dtype=kv, block_size=4, kv_cache_memory=4 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(100, 137))
    alone = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    cached = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    batched = llm.generate([list(range(200, 211)), prompt], greedy)[1].outputs[0].token_ids
    assert alone == cached == batched and llm.llm_engine.get_stats()["prefix_cache_hits"] > 0
    samples = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=0))[0].outputs
    assert len(samples) == 3


def test_draft_quantized_at_load_takes_the_heads_setting(tiny_model_dir: str) -> None:
    """A draft quantized at load ('draft:self@int4') quantizes its LM head when the engine does."""
    from tokenmill.config import EngineArgs
    from tokenmill.spec.draft import load_draft
    for lm_head in (False, True):
        args = EngineArgs(model=tiny_model_dir, quantization="int8", quantize_lm_head=lm_head,
                          speculative="draft:self@int4")
        draft = load_draft(args, tiny_model_dir, CPU, torch.float32)
        assert isinstance(draft.model.lm_head, QuantLMHead) == lm_head


def test_fp8_checkpoint_round_trip(tiny_model_dir: str, tmp_path) -> None:
    """`tokenmill quantize --method fp8` writes e4m3 weights with float32 scales and a quantization_config that
    loads back to the model quantized at load (its float tensors in float16); GPTQ is refused for fp8."""
    from tokenmill.quant.quantize import resolve_calibration
    fmt = QuantFormat.parse("fp8")
    out = quantize_checkpoint(tiny_model_dir, fmt, str(tmp_path / "q"), calibration="auto", dtype="float32",
                              device="cpu")
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["method"] == "fp8" and qc["group_size"] is None
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.float32
    config = load_model_config(tiny_model_dir)
    got = load_model(load_model_config(out), out)
    assert all(isinstance(m, QuantLinear) and m.fmt == fmt for m in linear_modules(got).values())
    want = load_model(config, tiny_model_dir, quantization="fp8")
    for p in want.parameters():   # what the folder holds: the unquantized tensors in float16
        if p.dtype == torch.float32:
            p.data = p.data.half().float()
    assert torch.allclose(_logprobs(got), _logprobs(want), atol=1e-5)
    for other in ("int8", "gguf"):
        with pytest.raises(ValueError, match=f"already quantized as fp8; quantization='{other}' does not match"):
            load_model(load_model_config(out), out, quantization=other)
    with pytest.raises(ValueError, match="gptq"):
        resolve_calibration("gptq", fmt)


def test_quantizing_a_quantized_gguf_says_it_rounds_twice(default_model_path: str, caplog) -> None:
    """--quantization int4 on the Q4_1 default model rounds the dequantized Q4_1 weights again: said, as llama.cpp
    refuses it without --allow-requantize; 'gguf' keeps the blocks and says nothing."""
    config = load_model_config(default_model_path)
    with caplog.at_level("WARNING", logger="tokenmill.quant.loading"):
        load_model(config, default_model_path, quantization="gguf")
        assert not caplog.records
        load_model(config, default_model_path, quantization="int4")
    (record,) = caplog.records
    assert "stores its weights as Q4_1" in record.getMessage() and "re-quantizes" in record.getMessage()
    assert "quantization='int4'" in record.getMessage() and "int4-g128" in record.getMessage()
