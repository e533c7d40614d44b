"""The default model (SmolLM2-135M-Instruct, shipped as Q4_1) quantized on the CPU: KL against the float
model over a few hundred tokens of the pydoc_data corpus stays under the targets, and greedy answers stay
sensible. (INT4 g128 needs GPTQ to reach its target, too slow for here: test_triton_quant.py checks it on the
GPU. INT4 g32 recovers the shipped Q4_1 blocks exactly: test_formats.py.)"""
from __future__ import annotations

import copy

import pytest
import torch

from tokenmill.model.loader import load_model, load_model_config
from tokenmill.quant.corpus import WindowRunner, corpus_text, corpus_windows
from tokenmill.quant.eval import compare, swapped
from tokenmill.quant.formats import QuantFormat, quantize
from tokenmill.quant.kv_cache import prepare_fp8_kv
from tokenmill.quant.loading import linear_modules
from tokenmill.tokenizer import load_tokenizer

CPU = torch.device("cpu")
WINDOW = 192


@pytest.fixture(scope="module")
def setup(default_model_path: str):
    config = load_model_config(default_model_path)
    ids = load_tokenizer(default_model_path).encode(corpus_text(), add_special_tokens=False)
    windows = corpus_windows(ids, 2 * WINDOW, WINDOW)
    net = load_model(config, default_model_path)
    base = [WindowRunner(net, WINDOW, CPU, torch.float32).logprobs(w) for w in windows]
    return net, windows, base


def _kl(setup, weights_fmt: str | None = None, kv: torch.dtype = torch.float32):
    net, windows, base = setup
    weights = {} if weights_fmt is None else {
        name: quantize(m.weight.data, QuantFormat.parse(weights_fmt)) for name, m in linear_modules(net).items()}
    with swapped(net, weights):
        if kv == torch.float8_e4m3fn:
            net = copy.deepcopy(net)
            prepare_fp8_kv(net, CPU, torch.float32, net.config.vocab_size)
        c, _ = compare(windows, base, [WindowRunner(net, WINDOW, CPU, kv).logprobs(w) for w in windows])
    return c


def test_int8_weights(setup) -> None:
    c = _kl(setup, "int8")
    assert c.kl_mean < 0.01 and c.top1_agreement > 0.9 and abs(c.ppl_change) < 0.02


def test_fp8_weights_and_activations(setup) -> None:
    """FP8 (e4m3 weights, activations per token) loses more than INT8 on this small model: 0.031 mean KL and
    +1.9% perplexity measured (docs/QUANTIZATION.md); a wrong scale or layout costs whole units."""
    c = _kl(setup, "fp8")
    assert c.kl_mean < 0.06 and c.top1_agreement > 0.8 and abs(c.ppl_change) < 0.05


@pytest.mark.parametrize("kv", [torch.float8_e4m3fn, torch.int8])
def test_kv_cache(setup, kv: torch.dtype) -> None:
    c = _kl(setup, kv=kv)
    assert c.kl_mean < 0.01 and c.top1_agreement > 0.9


def test_greedy_text_stays_sensible() -> None:
    """The shipped Q4_1 weights served as they are, with an int8 KV cache."""
    from tokenmill import LLM, SamplingParams
    llm = LLM(quantization="gguf", kv_cache_dtype="int8", kv_cache_memory=16 << 20)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in out[0].outputs[0].text
