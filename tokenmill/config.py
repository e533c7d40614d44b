"""Configuration dataclasses, validated once at engine start."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.quant.formats import QuantFormat

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


def parse_draft(speculative: str) -> tuple[str, str | None]:
    """'draft:<model>[@<quantization>]' -> (model, quantization); <model> 'self' is the target's checkpoint.
    The quantization is one tokenmill can apply at load: 'gguf' (a GGUF's own blocks) or an int8 / int4 / fp8 name."""
    body = speculative[len("draft:"):]
    model, at, quant = body.partition("@")
    if not model or (at and not quant):
        raise ValueError(f"speculative={speculative!r}: expected 'draft:<model>' or 'draft:<model>@<quantization>' "
                         "(<model>: a model path, or 'self' for the target's own weights)")
    if quant and quant != "gguf":
        try:
            QuantFormat.parse(quant)
        except ValueError as e:
            raise ValueError(f"speculative={speculative!r}: the draft's {e}, or gguf") from None
    return model, quant or None


# config.json sizes the model cannot be built without
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, with Hugging Face `config.json` names."""

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        if not isinstance(archs, list):
            raise ValueError(f"'architectures' must be a list such as [\"LlamaForCausalLM\"], got {archs!r}")
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; expected one of " + ", ".join(SUPPORTED_ARCHITECTURES))
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if d.get("sliding_window") and arch == "MistralForCausalLM" and d.get("use_sliding_window", True) \
                and d["sliding_window"] < d.get("max_position_embeddings", 0):
            raise ValueError("Mistral with sliding-window attention is not supported (sliding_window="
                             f"{d['sliding_window']}); use a checkpoint with sliding_window null")
        layer_types = d.get("layer_types") or (  # Qwen2/Qwen3: sliding layers from max_window_layers on
            ["sliding_attention" if i >= d.get("max_window_layers", 0) else "full_attention"
             for i in range(d["num_hidden_layers"])] if d.get("use_sliding_window") and d.get("sliding_window")
            else [])
        if arch != "MistralForCausalLM" and "sliding_attention" in layer_types \
                and (d.get("sliding_window") or 0) < d.get("max_position_embeddings", 4096):
            raise ValueError(f"{arch} with sliding-window attention is not supported (sliding_window="
                             f"{d.get('sliding_window')} on {layer_types.count('sliding_attention')} layers); use a "
                             "checkpoint with use_sliding_window false")
        if arch != "Qwen2ForCausalLM" and d.get("attention_bias"):
            raise ValueError(f"{arch} with attention_bias=true (a bias on o_proj too) is not supported")
        if d.get("mlp_bias"):
            raise ValueError(f"{arch} with mlp_bias=true is not supported")
        for key in _REQUIRED_SIZES:
            value = d.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key!r} must be a positive integer, got "
                                 f"{'nothing' if key not in d else repr(value)}")
        heads, kv_heads = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
        if not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"'num_key_value_heads' must be a positive integer dividing "
                             f"num_attention_heads={heads}, got {kv_heads!r}")
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rope_params = d.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_list,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["architectures"] = [d.pop("architecture")]
        d.pop("qk_norm")
        d["model_type"] = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[self.architecture]
        return d


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 4096
    policy: str = "fcfs"                    # "fcfs" | "priority"
    max_queue_len: int = 4096               # waiting requests beyond this are refused at once
    long_prefill_token_threshold: int = 0   # a prompt longer than this is "long"; 0 = no cap
    max_long_partial_prefills: int = 1      # long prompts chunked in at the same time
    priority_aging_s: float = 10.0          # every this many seconds of waiting raises priority by one level
    timeout_s: float | None = None          # default per-request deadline

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_queue_len",
                     "max_long_partial_prefills"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.priority_aging_s <= 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")


SPECULATIVE_OPTIONS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
_TYPE_WORDS = {"None": "null", "float": "a number", "int": "an integer", "bool": "true/false", "str": "a string",
               "dict[str,Any]": "a dict"}


@dataclass
class EngineArgs:
    """Every engine option, with vLLM's names; LLM(**kwargs) and the CLI map onto these."""

    model: str | None = None
    load_format: str = "auto"               # auto | safetensors | gguf | dummy
    model_preset: str | None = None         # config for load_format="dummy" without a folder
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False       # token ids in and out only (no text)
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None      # bytes for the KV pool; default: 512 MiB on CPU
    kv_cache_tokens: int | None = None      # or the pool as a number of tokens (SGLang's max_total_tokens)
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    max_queue_len: int = 4096
    long_prefill_token_threshold: int = 0
    max_long_partial_prefills: int = 1
    priority_aging_s: float = 10.0
    timeout_s: float | None = None
    generation_config: str = "auto"         # sampling defaults: auto (the model's) | vllm (none) | a folder's file
    override_generation_config: dict[str, Any] | None = None  # vLLM's: generation_config.json names over them
    enforce_eager: bool = False
    async_scheduling: bool = False          # schedule and launch step N+1 before reading step N's tokens
    quantization: str | None = None
    quantize_lm_head: bool = False          # the LM head quantized with the projections (quantization at load only)
    kv_cache_dtype: str = "auto"
    speculative: str | None = None          # None | "ngram" | "draft:<model>[@<quantization>]" (docs/SPECULATIVE.md)
    num_speculative_tokens: int = 4         # most draft tokens per request per step (the adaptive rule picks fewer)
    prompt_lookup_max: int = 4              # n-gram proposer: longest suffix looked up ...
    prompt_lookup_min: int = 2              # ... and shortest
    tensor_parallel_size: int = 1           # ranks the model is split over (GPUs, or CPU processes)
    nnodes: int = 1                         # torchrun's names: machines the ranks span ...
    node_rank: int = 0                      # ... this machine's index (0 runs the engine, others `tokenmill worker`)
    master_addr: str = "127.0.0.1"          # ... the address and port of rank 0's rendezvous
    master_port: int | None = None          # ... (None on one node: a free port)

    def __post_init__(self) -> None:
        self._check_types()
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"load_format must be one of auto, safetensors, gguf, dummy; got {self.load_format!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        # checked here too, not only by SchedulerConfig: the KV pool is sized from them before the scheduler
        # exists, where a bad value surfaces as a misleading "KV budget" error or a crash
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be an integer >= 1 (or unset: the model's), "
                             f"got {self.max_model_len}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override must be >= 2 (block 0 is the null block), "
                             f"got {self.num_gpu_blocks_override}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens must hold at least one block of {self.block_size} tokens, "
                             f"got {self.kv_cache_tokens}")
        if self.kv_cache_tokens is not None and (self.kv_cache_memory is not None or self.num_gpu_blocks_override):
            raise ValueError("give the KV pool one way: kv_cache_memory (bytes), kv_cache_tokens or "
                             "num_gpu_blocks_override, not several")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.model_preset is not None and self.load_format != "dummy":
            raise ValueError(f"model_preset={self.model_preset!r} is the architecture of random weights and needs "
                             f"load_format='dummy'; got load_format={self.load_format!r}")
        from tokenmill.model.generation_config import check_generation_config_args
        check_generation_config_args(self.generation_config, self.override_generation_config)
        self._check_speculative()
        self._check_parallel()

    def without_speculation(self) -> EngineArgs:
        """These options for a part that does not speculate (the draft model's runner)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in SPECULATIVE_OPTIONS}
        return dataclasses.replace(self, speculative=None, **defaults)

    def _check_types(self) -> None:
        """Each option against its annotation, as vLLM's pydantic configs do: LLM(enable_prefix_caching="false")
        would otherwise turn caching on (a non-empty string is true) and max_num_seqs=1.5 fail only after the
        model has loaded. A float with an integer value (kv_cache_memory=2e9) is taken as that integer."""
        for f in dataclasses.fields(self):
            value, kinds = getattr(self, f.name), f.type.replace(" ", "").split("|")
            if value is None and "None" in kinds:
                continue
            if isinstance(value, os.PathLike) and "str" in kinds:
                value = os.fspath(value)
                setattr(self, f.name, value)
            if "bool" in kinds:
                ok = isinstance(value, bool)
            elif "int" in kinds:
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                    setattr(self, f.name, value)
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif "float" in kinds:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            elif "dict[str,Any]" in kinds:
                ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
            else:
                ok = isinstance(value, str)
            if not ok:
                allowed = " or ".join(_TYPE_WORDS[k] for k in kinds)
                raise ValueError(f"{f.name} must be {allowed}, got {value!r} ({type(value).__name__})")

    def _check_speculative(self) -> None:
        """Speculative options, checked before any model loads: a bad draft spec would otherwise surface only
        after the target is loaded, a non-integer count as a TypeError deep in the scheduler, and a huge one as
        a step that scans that many draft lengths per request."""
        spec = self.speculative
        if spec is None:
            given = [f.name for f in dataclasses.fields(self) if f.name in SPECULATIVE_OPTIONS
                     and getattr(self, f.name) != f.default]
            if given:
                raise ValueError(f"{', '.join(given)} only apply to speculative decoding, which is off; set "
                                 "speculative ('ngram' or 'draft:<model>') too, or leave them out")
            return
        if spec != "ngram" and not spec.startswith("draft:"):
            raise ValueError(f"speculative must be 'ngram' or 'draft:<model>[@<quantization>]', got {spec!r}")
        if spec.startswith("draft:"):
            parse_draft(spec)
        k, budget = self.num_speculative_tokens, self.max_num_batched_tokens
        if not 1 <= k < budget:
            raise ValueError(f"num_speculative_tokens must be in [1, max_num_batched_tokens - 1 = {budget - 1}] "
                             f"(a request's newest token and its drafts share one step's token budget), got {k}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} and "
                             f"{self.prompt_lookup_max}")

    def _check_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if self.nnodes < 1 or tp % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} must be >= 1 and divide tensor_parallel_size={tp} "
                             "(every node runs the same number of ranks)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be a port number in [1, 65535], got {self.master_port}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("a multi-node launch (nnodes > 1) needs master_addr and master_port: rank 0's address, "
                             "reachable from every node")
        if tp > 1 and (self.speculative or "").startswith("draft:"):
            raise ValueError(f"speculative={self.speculative!r} needs tensor_parallel_size=1 (the draft model is not "
                             "split over ranks); use speculative='ngram'")
