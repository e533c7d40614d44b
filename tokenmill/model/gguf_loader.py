"""GGUF checkpoints (llama.cpp's format), read with the `gguf` package: config from the metadata, tensors
renamed to Hugging Face names and dequantized to float32, or handed out raw for packed-weight kernels.

llama.cpp's converter permutes the rows of attn_q/attn_k of the `llama` architecture so that rotary pairs
(2i, 2i+1) are adjacent (GPT-J style); our rotary rotates halves (NeoX style), so those rows are put back.
The permutation moves whole rows, so it is undone on packed blocks too, without dequantizing."""
from __future__ import annotations

import functools
import os
import re
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from tokenmill.config import ModelConfig
from tokenmill.layers.rotary import _inv_freq

GGUF_MAGIC = b"GGUF"
_EXPECTED = "a GGUF model file (llama.cpp format, starting with the magic bytes 'GGUF')"

# general.architecture -> Hugging Face architecture
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Llama 3.x GGUFs store llama3 rope scaling only as per-frequency factors (rope_freqs.weight); these are the
# scalings released models use, recognised by recomputing their factors.
_LLAMA3_ROPE_SCALINGS = (
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
)


class GGUFTensor(NamedTuple):
    """One checkpoint tensor as stored: `data` is float for F32/F16, else uint8 blocks [rows, bytes_per_row],
    rows already in Hugging Face order; `shape` is the logical Hugging Face shape (out_features, in_features)."""
    name: str
    qtype: GGMLQuantizationType
    data: np.ndarray
    shape: tuple[int, ...]


class _Reader(GGUFReader):
    """GGUFReader reading through a plain ndarray view of its memory map: slicing numpy's memmap subclass
    costs ~10 us a slice, and a vocabulary is ~10^5 slices, which made parsing 3x slower."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path: str) -> GGUFReader:
    """A parsed GGUF file; anything else raises ValueError naming the file. Cached: the config, the weights and
    the tokenizer all read the same file, and parsing its metadata takes seconds."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found; expected {_EXPECTED}")
    stat = os.stat(path)
    return _open_gguf(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GGUFReader:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (starts with {magic!r}); expected {_EXPECTED}")
    try:
        return _Reader(path)
    except Exception as e:  # the reader fails with whatever a truncated buffer or bad count produces
        raise ValueError(f"{path} is a corrupt or unsupported GGUF file ({type(e).__name__}: {e}); "
                         f"expected {_EXPECTED}") from e


def gguf_field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar, str or list."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def gguf_eos_ids(reader: GGUFReader) -> list[int]:
    """End-of-generation ids: eos plus end-of-turn/end-of-message where the file has them (Llama 3 instruct)."""
    ids = [gguf_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _architecture(reader: GGUFReader, path: str) -> str:
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    return arch


def _rope_scaling(reader: GGUFReader, arch: str, head_dim: int, base: float, path: str) -> dict[str, Any] | None:
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(gguf_field(reader, f"{arch}.rope.scaling.factor"))}
    if kind != "none":
        raise ValueError(f"{path}: rope scaling {kind!r} is not supported; supported: linear, llama3")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    # llama.cpp divides each frequency by its factor; find the llama3 scaling that gives these factors
    factors = torch.from_numpy(np.array(freqs.data, dtype=np.float64))
    plain = _inv_freq(head_dim, base, None)
    for scaling in _LLAMA3_ROPE_SCALINGS:
        if torch.allclose(plain / _inv_freq(head_dim, base, scaling), factors, rtol=1e-3):
            return dict(scaling)
    raise ValueError(f"{path}: rope_freqs.weight holds rope scaling factors that match no known llama3 scaling")


def load_gguf_config(path: str) -> ModelConfig:
    """ModelConfig from GGUF metadata, validated the same way as a config.json."""
    reader = open_gguf(path)
    arch = _architecture(reader, path)

    def need(key: str) -> Any:
        value = gguf_field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks '{arch}.{key}'")
        return value

    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ValueError(f"{path}: GGUF has no token_embd.weight tensor")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = gguf_field(reader, f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"{path}: partial rotary (rope dim {rope_dim} of head dim {head_dim}) is not supported")
    rope_theta = float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0))
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig.from_hf_dict({
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": int(names["token_embd.weight"].shape[-1]),  # GGUF dims are reversed: (hidden, vocab)
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(reader, arch, head_dim, rope_theta, path),
        "max_position_embeddings": int(gguf_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": gguf_eos_ids(reader),
    })


def _hf_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor; None for tensors the model does not hold (rope_freqs)."""
    if gguf_name == "rope_freqs.weight":
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows (2i, 2i+1) go back to (i, i + head_dim/2)."""
    return rows.reshape(n_head, rows.shape[0] // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_tensor_types(path: str) -> dict[str, GGMLQuantizationType]:
    """Hugging Face name -> storage type of every model tensor, read from the header only."""
    reader = open_gguf(path)
    types = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is not None:
            types[name] = GGMLQuantizationType(t.tensor_type)
    return types


def iter_gguf_raw_tensors(path: str) -> Iterator[GGUFTensor]:
    """Every model tensor as stored in the file (memory-mapped where no row permutation is needed)."""
    reader = open_gguf(path)
    arch = _architecture(reader, path)
    n_head = int(gguf_field(reader, f"{arch}.attention.head_count"))
    n_kv_head = int(gguf_field(reader, f"{arch}.attention.head_count_kv", n_head))
    for t in reader.tensors:
        try:
            name = _hf_name(t.name)
        except ValueError as e:
            raise ValueError(f"{path}: {e} for architecture {arch!r}") from None
        if name is None:
            continue
        data = t.data
        if arch == "llama" and ".self_attn.q_proj." in name:
            data = _unpermute_rows(data, n_head)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            data = _unpermute_rows(data, n_kv_head)
        yield GGUFTensor(name, GGMLQuantizationType(t.tensor_type), data, tuple(int(d) for d in reversed(t.shape)))


def dequantize_tensor(tensor: GGUFTensor) -> torch.Tensor:
    """float32 tensor of the logical shape."""
    try:
        values = dequantize(tensor.data, tensor.qtype)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {tensor.name} has type {tensor.qtype.name}, which cannot be "
                         f"dequantized ({e})") from e
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(tensor.shape))


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 CPU tensor) for every model tensor, dequantized one at a time."""
    for tensor in iter_gguf_raw_tensors(path):
        yield tensor.name, dequantize_tensor(tensor)
