"""Quantized weights under tensor parallelism. In process, two ranks are simulated layer by layer: each holds
exactly its cut of one rank's packed values, from float or packed shards, and a row-parallel split that cuts a
group is refused by name (by the engine before any rank starts). On CPU with gloo, two real ranks give one
rank's greedy tokens with per-row INT8 and INT4 g32, each holding half the packed bytes (a per-row INT8 scale
is kept whole by every row-parallel rank). FP8 ranks hold their cuts too; a row-parallel rank quantizes its own
slice of the activations, so two FP8 ranks stay close to one (same first tokens, half the bytes a rank)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from quant_helpers import quant_bytes, tiny_config, write_tiny_checkpoint

import tokenmill.distributed
import tokenmill.layers.linear
import tokenmill.quant.linear
from tokenmill import LLM, SamplingParams
from tokenmill.distributed import tp_size
from tokenmill.engine import tp_launcher
from tokenmill.kernels.quant_ref import quant_linear
from tokenmill.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.quant.formats import QuantFormat, QuantizedWeight, quantize
from tokenmill.quant.linear import QuantLinear, to_quant_linear

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(3 + 13 * i)] for i in range(2)]
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, max_num_batched_tokens=16,
              kv_cache_memory=1 << 20)


@contextlib.contextmanager
def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> Iterator[None]:
    """Build and load layers as `rank` of `world` would, in this process; all-reduce is left to the test."""
    with monkeypatch.context() as m:
        for module in (tokenmill.distributed, tokenmill.layers.linear, tokenmill.quant.linear):
            m.setattr(module, "tp_size", lambda: world, raising=False)
            m.setattr(module, "tp_rank", lambda: rank, raising=False)
        m.setattr(tokenmill.quant.linear, "all_reduce", lambda x: x)
        yield


def values(layer: QuantLinear) -> torch.Tensor:
    qw = QuantizedWeight(layer.fmt, layer.weight, layer.weight_scale, layer.weight_min, layer.in_features)
    return qw.dequantize()


def build(fmt: QuantFormat, tensors: dict[str, torch.Tensor | QuantizedWeight]) -> dict[str, QuantLinear]:
    """A column-parallel, a row-parallel and a QKV projection (4 query heads, 1 KV head) over 128 inputs."""
    layers = {"col": to_quant_linear(ColumnParallelLinear(128, 64), fmt, None),
              "row": to_quant_linear(RowParallelLinear(128, 48), fmt, None),
              "qkv": to_quant_linear(QKVParallelLinear(128, 16, 4, 1, bias=True), fmt, None)}
    layers["col"].load_shard("weight", tensors["col"])
    layers["row"].load_shard("weight", tensors["row"])
    for i, name in enumerate("qkv"):
        layers["qkv"].load_shard("weight", tensors[name], i)
        layers["qkv"].load_shard("bias", tensors[f"{name}_bias"], i)
    return layers


@pytest.mark.parametrize("method", ["int8", "int8-g32", "int4-g64", "fp8"])
@pytest.mark.parametrize("packed", [False, True], ids=["float", "packed"])
def test_each_rank_holds_its_cut_of_one_ranks_values(method: str, packed: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fmt, gen = QuantFormat.parse(method), torch.Generator().manual_seed(0)
    shapes = {"col": (64, 128), "row": (48, 128), "q": (64, 128), "k": (16, 128), "v": (16, 128)}
    tensors: dict = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    if packed:  # GGUF blocks or a quantized checkpoint: cut without going through float
        tensors = {name: quantize(w, fmt) for name, w in tensors.items()}
    tensors.update({f"{n}_bias": torch.randn(shapes[n][0], generator=gen) for n in "qkv"})
    one = build(fmt, tensors)
    ranks = []
    for rank in range(2):
        with as_rank(monkeypatch, rank, 2):
            ranks.append(build(fmt, tensors))
    x = torch.randn(5, 128, generator=gen)
    for rank, layers in enumerate(ranks):
        rows, cols = slice(32 * rank, 32 * (rank + 1)), slice(64 * rank, 64 * (rank + 1))
        assert torch.equal(values(layers["col"]), values(one["col"])[rows])
        assert torch.equal(values(layers["row"]), values(one["row"])[:, cols])
        kv = slice(64, 96)  # the one KV head's K and V rows, on both ranks
        assert torch.equal(values(layers["qkv"]), torch.cat([values(one["qkv"])[rows], values(one["qkv"])[kv]]))
        assert torch.equal(layers["qkv"].bias, torch.cat([one["qkv"].bias[rows], one["qkv"].bias[kv]]))
    partial = [r["row"](x[:, 64 * i:64 * (i + 1)]) for i, r in enumerate(ranks)]
    if fmt.fp8:  # each rank quantizes its own slice of x, with that slice's scales (as vLLM does)
        want = sum(quant_linear(x[:, 64 * i:64 * (i + 1)], one["row"].weight[:, 64 * i:64 * (i + 1)],
                                one["row"].weight_scale, None, 64, 64, None) for i in range(2))
        assert torch.allclose(sum(partial), want, atol=1e-4)
    else:
        assert torch.allclose(sum(partial), one["row"](x), atol=1e-4)


def test_row_parallel_split_that_cuts_a_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with as_rank(monkeypatch, 0, 2):
        with pytest.raises(ValueError, match=r"int4-g32 weights do not split over tensor_parallel_size=2 in a "
                                             r"row-parallel layer of 96 inputs: each rank would get 48 inputs, which "
                                             r"must be whole groups of 32 and whole 32-input packing blocks"):
            to_quant_linear(RowParallelLinear(96, 64), QuantFormat.parse("int4-g32"), None)
        assert to_quant_linear(RowParallelLinear(96, 64), QuantFormat.parse("int8"), None).in_features == 48


def test_engine_refuses_the_split_that_cuts_a_group_before_spawning(tiny_model_dir: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's down_proj has 96 inputs: 48 a rank, not whole groups of 32."""
    monkeypatch.setattr(tp_launcher, "spawn_ranks", lambda *_: pytest.fail("ranks were started"))
    with pytest.raises(ValueError, match="row-parallel layer of 96 inputs: each rank would get 48 inputs"):
        LLM(tiny_model_dir, tensor_parallel_size=2, quantization="int4-g32", **ENGINE)
    assert tp_size() == 1


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_path: str) -> str:
    """The tiny Qwen2 (q/k/v biases, 2 KV heads) with an MLP whose halves are whole groups of 32."""
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-tp")), default_model_path,
                                 tiny_config(intermediate_size=128))


def expected_share(model: torch.nn.Module, tp: int) -> tuple[int, int]:
    """One rank's (packed, scale and min) bytes: 1/tp of everything but per-row scales of row-parallel layers."""
    packed = meta = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            packed += m.weight.numel() * m.weight.element_size() // tp
            size = sum(t.numel() * t.element_size() for t in (m.weight_scale, m.weight_min) if t is not None)
            meta += size if m.col_range is not None and m.fmt.group_size is None else size // tp
    return packed, meta


@pytest.mark.parametrize("method,lm_head", [("int8", False), ("int4-g32", False), ("int4-g32", True)])
def test_tp2_equals_tp1_quantized(method: str, lm_head: bool, tp_model_dir: str) -> None:
    """lm_head: each rank holds its slice of the vocabulary's packed rows and the logits are gathered."""
    ref = LLM(tp_model_dir, quantization=method, quantize_lm_head=lm_head, **ENGINE)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, GREEDY)]
    total, share = quant_bytes(ref.llm_engine.runner), expected_share(ref.llm_engine.runner.model, 2)
    del ref
    llm = LLM(tp_model_dir, tensor_parallel_size=2, quantization=method, quantize_lm_head=lm_head, **ENGINE)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    per_rank = llm.llm_engine.collective_rpc(quant_bytes)
    assert per_rank == [share, share] and share[0] == total[0] // 2
    llm.llm_engine.shutdown()
    assert tp_size() == 1


def test_tp2_fp8_holds_half_and_stays_close_to_tp1(tp_model_dir: str) -> None:
    """FP8 over two gloo ranks: half the e4m3 bytes a rank, and the same first token of every prompt as one rank.
    Later tokens may part (a row-parallel rank scales its own slice of the activations); the first token's
    logprob agrees to e4m3's rounding."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1)
    ref = LLM(tp_model_dir, quantization="fp8", **ENGINE)
    want = [o.outputs[0] for o in ref.generate(PROMPTS, params)]
    total, share = quant_bytes(ref.llm_engine.runner), expected_share(ref.llm_engine.runner.model, 2)
    del ref
    llm = LLM(tp_model_dir, tensor_parallel_size=2, quantization="fp8", **ENGINE)
    got = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    per_rank = llm.llm_engine.collective_rpc(quant_bytes)
    llm.llm_engine.shutdown()
    assert per_rank == [share, share] and share[0] == total[0] // 2
    for a, b in zip(got, want):
        assert a.token_ids[0] == b.token_ids[0]
        first_a, first_b = a.logprobs[0].logprob, b.logprobs[0].logprob
        assert abs(first_a - first_b) < 0.05 * abs(first_b) + 0.05
