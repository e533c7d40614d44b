"""The Llama family decoder, written once: Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2 (qkv bias),
Qwen3 (q/k RMSNorm). Differences are config flags, never separate code paths."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.layers.attention import PagedAttention
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.distributed import tp_size
from tokenmill.layers.linear import (MergedColumnParallelLinear, MergedLinear, QKVParallelLinear, RowParallelLinear,
                                     kv_heads_per_rank)
from tokenmill.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp_size()
        self.num_kv_heads = kv_heads_per_rank(config.num_key_value_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rms_eps: float | None, residual: torch.Tensor,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        """residual + attention(x): x and rms_eps as RMSNorm.for_projection gives them."""
        qkv = self.qkv_proj(x, rms_eps=rms_eps)
        q, k, v = qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        o = self.attn(positions, q, k, v, cos_sin_cache)
        return self.o_proj(o.view(-1, self.q_size), residual=residual)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; supported: silu")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_in_down = False  # SiLU·mul folded into down_proj's input (FP8: its quantization kernel)

    def forward(self, x: torch.Tensor, rms_eps: float | None, residual: torch.Tensor) -> torch.Tensor:
        """residual + mlp(x): x and rms_eps as RMSNorm.for_projection gives them. SiLU·mul runs in gate/up's
        call (Linear.silu_and_mul: INT4 decode fuses it into the product) unless down_proj takes it."""
        if self.act_in_down:
            return self.down_proj(self.gate_up_proj(x, rms_eps=rms_eps), residual=residual)
        return self.down_proj(self.gate_up_proj.silu_and_mul(x, rms_eps=rms_eps), residual=residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        """The residual stream after this layer. The residual adds happen in the o and down projections' stores."""
        hidden = self.self_attn(positions, *self.input_layernorm.for_projection(hidden), hidden, cos_sin_cache)
        return self.mlp(*self.post_attention_layernorm.for_projection(hidden), hidden)

    def fold_norms(self) -> None:
        """Fold the two norms' weights into the projections they feed, and SiLU·mul into the down projection,
        where those projections take them (Linear.fold_norm, fold_silu_and_mul)."""
        self.input_layernorm.fold_into(self.self_attn.qkv_proj)
        self.post_attention_layernorm.fold_into(self.mlp.gate_up_proj)
        self.mlp.act_in_down = self.mlp.down_proj.fold_silu_and_mul()


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin_cache
        for layer in self.layers:
            hidden = layer(positions, hidden, cos_sin)
        return self.norm(hidden)


# checkpoint name fragment -> (merged module fragment, shard index)
_STACKED = (("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
            ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def fold_norms(self) -> None:
        """Fold every layer's norms (and SiLU·mul) into the projections they feed where those take them (the
        final norm stays: its LM head may be tied to the embeddings)."""
        for layer in self.model.layers:
            layer.fold_norms()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_rows, vocab]."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; q/k/v and gate/up go into their merged layers.
        Every parameter must be covered, else the checkpoint is reported incomplete. A tied LM head that no
        longer shares the embedding's parameter (quantized: quant/linear.py) loads the embedding's tensor, or the
        quantized head a `tokenmill quantize` folder stores (calibrated on its own inputs); a float lm_head.weight
        beside a tied config is ignored, as transformers ties it over whatever the file holds."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        tied = self.config.tie_word_embeddings and self.lm_head.weight is self.model.embed_tokens.weight
        loaded: set[str] = set()
        embedding = None
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if isinstance(tensor, torch.Tensor) and (not tensor.is_floating_point() or tensor.element_size() < 2):
                raise ValueError(f"tensor {name!r} holds {str(tensor.dtype).removeprefix('torch.')} values; a "
                                 "weight must be floating point (float32, float16 or bfloat16), or packed by "
                                 "`tokenmill quantize` with its quantization_config in config.json")
            if name == "model.embed_tokens.weight" and self.config.tie_word_embeddings and not tied:
                embedding = tensor  # for a tied head that is no longer the embedding's parameter
            # a tied head is the embedding, as in transformers; a QuantizedWeight (not a Tensor) is a quantize
            # folder's calibrated head and loads below
            if name == "lm_head.weight" and self.config.tie_word_embeddings and (
                    tied or isinstance(tensor, torch.Tensor)):
                continue
            module_name, _, attr = name.rpartition(".")
            shard = None
            for ckpt, merged, idx in _STACKED:
                if f".{ckpt}" in module_name:
                    module_name, shard = module_name.replace(ckpt, merged), idx
                    break
            module = modules.get(module_name)
            if module is None or attr not in ("weight", "bias"):
                raise ValueError(f"unexpected tensor {name!r} in checkpoint for {self.config.architecture}")
            if hasattr(module, "load_shard"):
                try:
                    module.load_shard(attr, tensor, shard)
                except ValueError as e:  # the layer knows only its parameter's name: name the checkpoint's tensor
                    raise ValueError(f"tensor {name!r}: {e}") from None
            else:
                param = getattr(module, attr)
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                     f"model {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add(f"{module_name}.{attr}" + (f"#{shard}" if shard is not None else ""))
        if self.config.tie_word_embeddings and not tied and "lm_head.weight" not in loaded and embedding is not None:
            self.lm_head.load_shard("weight", embedding)
            loaded.add("lm_head.weight")
        expected = set()
        for pname in params:
            module_name, _, attr = pname.rpartition(".")
            module = modules[module_name]
            if isinstance(module, MergedLinear):
                expected.update(f"{pname}#{i}" for i in range(len(module.output_sizes)))
            else:
                expected.add(pname)
        if tied:
            expected.discard("lm_head.weight")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
