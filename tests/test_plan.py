"""The capacity planner against hand calculations (Llama-3-8B, Qwen3-8B) and its CLI."""
import json

import pytest

from tokenmill.cli import main
from tokenmill.model.presets import get_preset
from tokenmill.plan import kv_bytes_per_token, make_plan, num_parameters, weight_bytes

GiB = 1 << 30


def test_llama3_8b_by_hand():
    c = get_preset("llama-3-8b")
    assert kv_bytes_per_token(c, "bf16") == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_bytes_per_token(c, "fp8") == 65536
    assert kv_bytes_per_token(c, "int8") == 2 * 32 * 8 * (128 + 4) == 67584          # + fp32 per-token-head scales
    # embed + untied head 2 x 128256 x 4096; per layer q,o 4096^2, k,v 4096 x 1024, MLP 3 x 4096 x 14336, 2 norms
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    params = 2 * 128256 * 4096 + 32 * layer + 4096
    assert num_parameters(c) == params == 8_030_261_248
    assert weight_bytes(c, "bf16") == 2 * params == 16_060_522_496                     # 16.06 GB
    assert weight_bytes(c, "fp32") == 4 * params
    # int4: linear weights at half a byte + a 2-byte scale and a 2-byte min per 128 inputs per output row;
    # the rest in bf16
    linear = layer - 2 * 4096
    scales = (4096 + 1024 + 1024) * 32 + 4096 * 32 + 2 * 14336 * 32 + 4096 * 112
    assert weight_bytes(c, "int4") == 32 * (linear // 2 + 4 * scales + 2 * 2 * 4096) + 2 * (2 * 128256 * 4096 + 4096)
    int8_scales = 4096 + 1024 + 1024 + 4096 + 2 * 14336 + 4096
    assert weight_bytes(c, "int8") == 32 * (linear + 2 * int8_scales + 2 * 2 * 4096) + 2 * (2 * 128256 * 4096 + 4096)
    # tp 2: every linear, embedding and head halved, norms replicated; 4 KV heads per rank
    assert weight_bytes(c, "bf16", tp=2) == 32 * (linear + 2 * 2 * 4096) + 2 * 128256 * 4096 + 2 * 4096
    assert kv_bytes_per_token(c, "bf16", tp=2) == 65536


def test_llama3_8b_capacity_on_80gib():
    p = make_plan("llama-3-8b", get_preset("llama-3-8b"), 80 * GiB)
    usable = int(80 * GiB * 0.9)
    acts = 2048 * (4 * 4096 + 4096 + 2 * 1024 + 3 * 14336) * 2 + 2 * 256 * 128256 * 4 + GiB
    assert (p.usable_bytes, p.activation_bytes) == (usable, acts)
    blocks = (usable - 16_060_522_496 - acts) // (131072 * 16)
    assert (p.kv_blocks, p.kv_tokens) == (blocks, blocks * 16) == (28440, 455040)
    assert p.max_concurrent == blocks // (2048 // 16) and p.max_concurrent_full == blocks // (8192 // 16)
    assert p.fits


def test_qwen3_8b_by_hand():
    c = get_preset("qwen3-8b")
    assert kv_bytes_per_token(c, "bf16") == 2 * 36 * 8 * 128 * 2 == 147456
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128   # + q/k norms
    assert num_parameters(c) == 2 * 151936 * 4096 + 36 * layer + 4096 == 8_190_735_360
    assert weight_bytes(c, "bf16") == 2 * 8_190_735_360


def test_kv_heads_replicate_when_fewer_than_ranks():
    c = get_preset("qwen3-0.6b")                       # 16 heads, 8 KV heads
    assert kv_bytes_per_token(c, "bf16", tp=16) == 2 * 28 * 1 * 128 * 2
    assert kv_bytes_per_token(c, "bf16", tp=4) == 2 * 28 * 2 * 128 * 2
    with pytest.raises(ValueError, match="divide"):
        kv_bytes_per_token(c, "bf16", tp=3)


def test_fit_verdicts():
    c = get_preset("llama-3-70b")
    assert not make_plan("70b", c, 80 * GiB).fits                       # 141 GB of bf16 weights
    assert make_plan("70b", c, 80 * GiB, tp=4).fits
    assert make_plan("70b", c, 80 * GiB, weight_dtype="int4").fits     # ~37 GB of int4 weights
    tight = make_plan("8b", get_preset("llama-3-8b"), 18 * GiB, max_model_len=8192)
    assert not tight.fits and "max_model_len" in tight.reason
    with pytest.raises(ValueError, match="weight dtype"):
        make_plan("8b", get_preset("llama-3-8b"), 80 * GiB, weight_dtype="int3")


def test_cli(capsys):
    main(["plan", "--model", "llama-3-8b", "--memory", "80GiB"])
    out = capsys.readouterr().out
    assert "16.06 GB" in out and "131,072 B" in out and "455,040 tokens" in out and "fits             yes" in out
    main(["plan", "--model", "mistral-7b", "--memory", "24GB", "--kv-dtype", "fp8", "--tp", "2", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert d["kv_bytes_per_token"] == 2 * 32 * 4 * 128 and d["tp"] == 2 and d["fits"]
    main(["plan", "--memory", "8GiB"])                                    # the default model's GGUF header
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "23,040 B" in out          # 2 x 30 layers x 3 KV heads x 64 x 2 B
