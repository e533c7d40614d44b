"""The capacity planner against hand calculations (Llama-3-8B, the Qwen3 family) and its CLI."""
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
    # fp8: a byte a weight and a float32 scale a row
    assert weight_bytes(c, "fp8") == 32 * (linear + 4 * int8_scales + 2 * 2 * 4096) + 2 * (2 * 128256 * 4096 + 4096)
    # the LM head quantized: packed at half a byte with a scale and a min per 128 inputs; the embedding stays bf16
    head_int4 = 128256 * 4096 // 2 + 4 * 128256 * 32
    assert (weight_bytes(c, "int4", quantize_lm_head=True)
            == weight_bytes(c, "int4") - 2 * 128256 * 4096 + head_int4)
    with pytest.raises(ValueError, match="needs an int8, fp8 or int4"):
        weight_bytes(c, "bf16", quantize_lm_head=True)
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


def test_activations_of_a_budget_beyond_one_context():
    """A step budget larger than max_model_len holds several prompts: the activations are the whole budget's
    (at most max_num_seqs prompts of max_model_len), as the engine's memory profile runs them."""
    c = get_preset("llama-3-8b")
    per_token = (4 * 4096 + 4096 + 2 * 1024 + 3 * 14336) * 2
    p = make_plan("llama-3-8b", c, 141 * GiB, max_model_len=8192, max_num_batched_tokens=65536)
    assert p.activation_bytes == 65536 * per_token + 2 * 256 * 128256 * 4 + GiB
    p = make_plan("llama-3-8b", c, 141 * GiB, max_model_len=8192, max_num_batched_tokens=65536, max_num_seqs=2)
    assert p.activation_bytes == 2 * 8192 * per_token + 2 * 2 * 128256 * 4 + GiB


def test_qwen3_8b_by_hand():
    c = get_preset("qwen3-8b")
    assert kv_bytes_per_token(c, "bf16") == 2 * 36 * 8 * 128 * 2 == 147456
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128   # + q/k norms
    assert num_parameters(c) == 2 * 151936 * 4096 + 36 * layer + 4096 == 8_190_735_360
    assert weight_bytes(c, "bf16") == 2 * 8_190_735_360


def test_qwen3_14b_by_hand():
    c = get_preset("qwen3-14b")
    assert kv_bytes_per_token(c, "bf16") == 2 * 40 * 8 * 128 * 2 == 163840
    assert kv_bytes_per_token(c, "fp8") == 81920
    assert kv_bytes_per_token(c, "bf16", tp=2) == 2 * 40 * 4 * 128 * 2 == 81920
    # untied embed + head 2 x 151936 x 5120; per layer q,o 5120 x (40 x 128 = 5120), k,v 5120 x (8 x 128), MLP
    # 3 x 5120 x 17408, 2 norms of 5120 and the q/k norms of 128: 14.8 B, 13.2 B without embed and head (model card)
    layer = 2 * 5120 * 5120 + 2 * 5120 * 1024 + 3 * 5120 * 17408 + 2 * 5120 + 2 * 128
    params = 2 * 151936 * 5120 + 40 * layer + 5120
    assert num_parameters(c) == params == 14_768_307_200
    assert 40 * layer + 5120 == 13_212_482_560
    assert weight_bytes(c, "bf16") == 2 * params == 29_536_614_400                   # 29.54 GB
    # on 80 GiB: 77.31 GB usable - 29.54 GB weights - activations of a 2048-token step, 256 rows of float32 logits
    # and probabilities, 1 GiB workspace
    p = make_plan("qwen3-14b", c, 80 * GiB)
    acts = 2048 * (4 * 5120 + 5120 + 2 * 1024 + 3 * 17408) * 2 + 2 * 256 * 151936 * 4 + GiB
    blocks = (int(80 * GiB * 0.9) - 29_536_614_400 - acts) // (163840 * 16)
    assert (p.activation_bytes, p.kv_blocks, p.kv_tokens) == (acts, blocks, blocks * 16) == (acts, 17570, 281120)
    assert p.max_model_len == 40960 and p.max_concurrent_full == blocks // (40960 // 16) == 6 and p.fits


def test_qwen3_family():
    # (preset, layers, bf16 weight bytes); all have 8 KV heads of 128
    family = [("qwen3-0.6b", 28, 1_192_099_840), ("qwen3-1.7b", 28, 3_441_149_952), ("qwen3-4b", 36, 8_044_936_192),
              ("qwen3-8b", 36, 16_381_470_720), ("qwen3-14b", 40, 29_536_614_400), ("qwen3-32b", 64, 65_524_246_528)]
    for name, layers, wbytes in family:
        c = get_preset(name)
        assert kv_bytes_per_token(c, "bf16") == 2 * layers * 8 * 128 * 2, name
        assert weight_bytes(c, "bf16") == 2 * num_parameters(c) == wbytes, name
    # 1.7B ties the LM head to the embedding: 3.44 GB, the size of its model.safetensors (untied would be 4.06 GB)
    c = get_preset("qwen3-1.7b")
    layer = 2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 6144 + 2 * 2048 + 2 * 128
    assert num_parameters(c) == 151936 * 2048 + 28 * layer + 2048 == 1_720_574_976
    # 32B: 64 heads x 128 = 8192 query features from a 5120-wide hidden state
    c = get_preset("qwen3-32b")
    layer = 2 * 5120 * 8192 + 2 * 5120 * 1024 + 3 * 5120 * 25600 + 2 * 5120 + 2 * 128
    assert num_parameters(c) == 2 * 151936 * 5120 + 64 * layer + 5120 == 32_762_123_264   # 32.8 B (model card)
    # one 80 GiB device holds the 65.5 GB of bf16 weights but not a 40960-token request; two ranks do
    p = make_plan("qwen3-32b", c, 80 * GiB)
    assert p.weight_bytes < p.usable_bytes and p.kv_tokens < 40960 and not p.fits and "max_model_len" in p.reason
    assert make_plan("qwen3-32b", c, 80 * GiB, tp=2).fits


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


def test_cli_checkpoint_folder(tmp_path, capsys):
    """`--model <folder>` reads only config.json (no weights): the same numbers as the preset it describes."""
    # tiny-llama's architecture in the keys transformers 5 writes (LlamaConfig(..., architectures=["LlamaForCausalLM"],
    # dtype="float32").save_pretrained, less initializer_range, use_cache and the like): "dtype", "rope_parameters"
    folder = tmp_path / "tiny-llama-ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "bos_token_id": 1,
        "dtype": "float32", "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
        "intermediate_size": 128, "max_position_embeddings": 4096, "mlp_bias": False, "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
        "vocab_size": 256}))
    main(["plan", "--model", str(folder), "--memory", "8GiB", "--json"])
    d = json.loads(capsys.readouterr().out)
    main(["plan", "--model", "tiny-llama", "--memory", "8GiB", "--json"])
    preset = json.loads(capsys.readouterr().out)
    assert d["model"] == "tiny-llama-ckpt" and preset["model"] == "tiny-llama"
    assert {k: v for k, v in d.items() if k != "model"} == {k: v for k, v in preset.items() if k != "model"}
    # by hand: a float32 checkpoint runs in bf16 on a GPU, as the engine's "auto" picks; KV 2 x 2 layers x 2 KV
    # heads x 16 x 2 B
    assert (d["weight_dtype"], d["kv_dtype"], d["kv_bytes_per_token"]) == ("bf16", "bf16", 2 * 2 * 2 * 16 * 2)
    # embed + untied head 2 x 256 x 64; per layer q,o 64 x 64, k,v 64 x 32, MLP 3 x 64 x 128, 2 norms; final norm
    params = 2 * 256 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert d["num_parameters"] == params == 106_816 and d["weight_bytes"] == 2 * params
    assert d["max_model_len"] == 4096 and d["fits"]
    main(["plan", "--model", str(folder), "--memory", "8GiB"])
    out = capsys.readouterr().out
    assert "tiny-llama-ckpt (LlamaForCausalLM" in out and "256 B (bf16: 2 x 2 layers x 2 KV heads x (16 x 2 B))" in out


def test_auto_dtype_of_a_float32_checkpoint_is_what_the_engine_picks_on_a_gpu():
    """The engine runs a float32 checkpoint in bf16 on a GPU (engine/devices.pick_dtype): so does the plan."""
    c = get_preset("tiny-llama")
    assert c.torch_dtype == "float32"
    p = make_plan("tiny-llama", c, GiB)
    assert p.weight_dtype == "bf16" and p.kv_bytes_per_token == kv_bytes_per_token(c, "bf16")


def test_cli_bad_input_is_a_message_not_a_traceback():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "plan", "--model", "tiny-llama", "--tp", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "tokenmill: error: --tp 3" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flags, match", [
    (["--block-size", "0"], "--block-size must be at least 1, got 0"),               # ZeroDivisionError
    (["--max-model-len", "-1"], "--max-model-len must be at least 1, got -1"),        # ZeroDivisionError
    (["--avg-context", "-1"], "--avg-context must be at least 1, got -1"),            # ZeroDivisionError
    (["--memory", "-1"], "--memory must be at least 1, got -1"),                      # "fits NO"
    (["--max-num-seqs", "-1"], "--max-num-seqs must be at least 1, got -1"),          # negative logits reserve
    (["--gpu-memory-utilization", "-1"], "--gpu-memory-utilization must be in"),      # "fits NO"
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization must be in"),     # "cannot convert float NaN"
    (["--weight-dtype", "fp8", "--group-size", "32"], "--group-size applies to int4"),  # silently the same plan
    # "fits yes" for what the engine refuses: the engine's rules and messages
    (["--max-model-len", "100000"], "max_model_len=100000 exceeds the model's max_position_embeddings 8192"),
    (["--block-size", "24"], "block_size must be a power of two >= 1, got 24"),
    (["--weight-dtype", "int4", "--group-size", "0"], r"group size must be one of \(32, 64, 128\), got 0"),  # 128
    (["--weight-dtype", "int4", "--group-size", "48"], r"group size must be one of \(32, 64, 128\), got 48"),
])
def test_cli_sizes_out_of_range_are_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        main(["plan", "--model", "llama-3-8b", *flags])


def test_sizes_with_units_and_bad_ones():
    """inf, 1e400 and nan were an OverflowError (a traceback); the error now lists what is accepted."""
    from tokenmill.units import parse_bytes
    assert [parse_bytes(t) for t in ("1073741824", "1GiB", " 512mib ", "2GB", "1.5KB", "10B")] == \
        [1 << 30, 1 << 30, 512 << 20, 2 * 10 ** 9, 1500, 10]
    for text in ("inf", "1e400", "nan", "-inf", "1e300TiB", "80G", "", "GiB"):
        with pytest.raises(ValueError, match=f"invalid size {text!r}: expected a number of bytes, optionally with a "
                                             r"unit .*KB, MB, GB, TB .*KiB, MiB, GiB, TiB"):
            parse_bytes(text)
