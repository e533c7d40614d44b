"""Parity with transformers: tiny random Llama/Mistral/Qwen2/Qwen3 checkpoints saved as safetensors or written
as GGUF (q/k permuted the way llama.cpp's converter does), and the default SmolLM2 GGUF, run through our
paged-attention forward in chunks (prefill, continuation, decode)."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

transformers = pytest.importorskip("transformers")

from tokenmill.layers.attention import AttentionMetadata, PagedAttention, forward_context  # noqa: E402
from tokenmill.model.gguf_loader import iter_gguf_raw_tensors, iter_gguf_weights  # noqa: E402
from tokenmill.model.loader import load_model, load_model_config  # noqa: E402
from tokenmill.tokenizer import load_tokenizer  # noqa: E402

BLOCK_SIZE = 4
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def run_chunks(model: torch.nn.Module, ids: list[int], bounds: list[int]) -> torch.Tensor:
    """Logits for every token of one sequence, fed as chunks ids[0:b0], ids[b0:b1], ... through a paged cache
    whose blocks are deliberately out of order."""
    cfg = model.config
    num_blocks = (len(ids) + BLOCK_SIZE - 1) // BLOCK_SIZE
    for module in model.modules():
        if isinstance(module, PagedAttention):
            shape = (num_blocks + 1, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
            module.k_cache, module.v_cache = torch.zeros(shape), torch.zeros(shape)
    block_table = torch.arange(num_blocks, 0, -1, dtype=torch.int32)  # block 0 unused, rest reversed
    logits, start = [], 0
    for end in bounds:
        positions = torch.arange(start, end)
        meta = AttentionMetadata(
            slot_mapping=(block_table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).long(),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32), block_tables=block_table[None],
            max_query_len=end - start, max_seq_len=end)
        with forward_context(meta), torch.no_grad():
            logits.append(model.compute_logits(model(torch.tensor(ids[start:end]), positions)))
        start = end
    return torch.cat(logits)


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def randomize(model: torch.nn.Module) -> None:
    """Replace transformers' init (norms 1, biases 0) by values that make every weight matter."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)


def tiny_hf_model(config_cls: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**TINY, **extra, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    randomize(model)
    return model


def sample_ids(n: int = 11) -> list[int]:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(1)).tolist()


CASES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama-tied-llama3-rope": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3-tied": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-untied": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("fold_norms", [False, True], ids=["norms", "folded"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("case", list(CASES))
def test_tiny_safetensors_parity(case: str, sharded: bool, fold_norms: bool, tmp_path) -> None:
    """fold_norms: the layers' norm weights (random here) folded into the projections, as the engine loads."""
    config_cls, extra = CASES[case]
    ref = tiny_hf_model(config_cls, **extra)
    ref.save_pretrained(tmp_path, max_shard_size="40KB" if sharded else "1GB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json") == sharded

    ours = load_model(load_model_config(str(tmp_path)), str(tmp_path), dtype=torch.float32, fold_norms=fold_norms)
    assert all((layer.input_layernorm.weight is None) == fold_norms for layer in ours.model.layers)
    ids = sample_ids()
    got = run_chunks(ours, ids, [6, 10, 11])  # prefill, chunked continuation, one decode step
    torch.testing.assert_close(got, hf_logits(ref, ids), rtol=1e-4, atol=1e-4)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotary halves -> interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: str, model: torch.nn.Module, arch: str, qtype: QT = QT.F32,
               output_qtype: QT | None = None) -> None:
    """A GGUF as llama.cpp's converter writes it: gguf-py's own name map, q/k permuted for llama, matrices in
    `qtype` (the output matrix in output_qtype if given), no output.weight when tied."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads if getattr(cfg, "head_dim", None) is None else cfg.head_dim
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.numpy()
        if arch == "llama" and base.endswith("q_proj"):
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        tensor_qtype = output_qtype if output_qtype is not None and hf_name == "lm_head.weight" else qtype
        if data.ndim == 2 and tensor_qtype != QT.F32:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", quantize(data, tensor_qtype), raw_dtype=tensor_qtype)
        else:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_CASES = {
    "llama": ("LlamaConfig", "llama", dict(tie_word_embeddings=False)),
    "llama-tied": ("LlamaConfig", "llama", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "qwen2", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "qwen3", dict(head_dim=32, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_tiny_gguf_parity(case: str, tmp_path) -> None:
    config_cls, arch, extra = GGUF_CASES[case]
    ref = tiny_hf_model(config_cls, **extra)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, ref, arch)
    config = load_model_config(path)
    assert config.tie_word_embeddings == extra["tie_word_embeddings"]
    ours = load_model(config, path, dtype=torch.float32)
    ids = sample_ids()
    torch.testing.assert_close(run_chunks(ours, ids, [6, 10, 11]), hf_logits(ref, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1], ids=lambda q: q.name)
def test_quantized_gguf_weights(qtype: QT, tmp_path) -> None:
    """Quantization blocks run along rows, so un-permuting q/k rows commutes with it: every loaded weight must
    equal dequantize(quantize(W)) of the Hugging Face weight exactly, packed or not."""
    ref = tiny_hf_model("LlamaConfig", tie_word_embeddings=False)
    path = str(tmp_path / f"tiny-{qtype.name}.gguf")
    write_gguf(path, ref, "llama", qtype)
    state = ref.state_dict()
    loaded = dict(iter_gguf_weights(path))
    assert loaded.keys() == state.keys()
    for name, tensor in loaded.items():
        want = state[name].numpy()
        if want.ndim == 2:
            want = dequantize(quantize(want, qtype), qtype)
        np.testing.assert_array_equal(tensor.numpy(), want, err_msg=name)
    raw = {t.name: t for t in iter_gguf_raw_tensors(path)}
    q = raw["model.layers.0.self_attn.q_proj.weight"]
    assert q.qtype == qtype and q.shape == tuple(state["model.layers.0.self_attn.q_proj.weight"].shape)


@pytest.mark.parametrize("qtype,output_qtype", [(QT.Q8_0, None), (QT.Q4_1, None), (QT.Q4_0, None),
                                                (QT.Q8_0, QT.F16)], ids=str)
def test_gguf_native_output_tensor(qtype: QT, output_qtype: QT | None, tmp_path) -> None:
    """quantization='gguf' keeps a quantized output tensor packed too (as llama.cpp runs it): the LM head is a
    QuantLMHead, unless the file stores it in a type without a native format (F16 here), and the logits are
    those of the dequantized file."""
    from tokenmill.quant.linear import QuantLMHead
    ref = tiny_hf_model("LlamaConfig", tie_word_embeddings=False)
    path = str(tmp_path / f"tiny-{qtype.name}.gguf")
    write_gguf(path, ref, "llama", qtype, output_qtype)
    config = load_model_config(path)
    native = load_model(config, path, dtype=torch.float32, quantization="gguf")
    if output_qtype is None:
        assert isinstance(native.lm_head, QuantLMHead) and native.lm_head.fmt.bits == (8 if qtype == QT.Q8_0 else 4)
    else:
        assert not isinstance(native.lm_head, QuantLMHead) and native.lm_head.weight.dtype == torch.float32
    dense = load_model(config, path, dtype=torch.float32)
    ids = sample_ids()
    torch.testing.assert_close(run_chunks(native, ids, [6, 10, 11]), run_chunks(dense, ids, [6, 10, 11]),
                               rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def hf_gguf_model(default_model_path: str) -> torch.nn.Module:
    """transformers' own GGUF load of the file: what `from_pretrained(dir, gguf_file=...)` runs for llama
    (config + load_gguf_checkpoint, which dequantizes and un-permutes q/k), minus its `accelerate` requirement."""
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    folder, name = os.path.split(default_model_path)
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    config._attn_implementation = "eager"
    with no_init_weights():  # every weight is loaded below; random init would only cost time
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(default_model_path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def test_default_gguf_parity(default_model_path: str, hf_gguf_model: torch.nn.Module) -> None:
    """As the engine loads it: norms folded into the projections."""
    ours = load_model(load_model_config(default_model_path), default_model_path, dtype=torch.float32,
                      fold_norms=True)
    tok = load_tokenizer(default_model_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer briefly."}])
    ids = tok.encode(prompt)
    got = run_chunks(ours, ids, [len(ids) - 5, len(ids) - 1, len(ids)])
    want = hf_logits(hf_gguf_model, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
