"""Tensor parallelism on CPU with gloo: ranks 1.. are real processes that replay rank 0's forwards. Greedy tokens
equal one rank's on tiny random Llama / Qwen2 / Qwen3 checkpoints and on the default model; each rank holds
only its share of the weights; bad sizes fail before any process starts; a killed rank ends the engine with
a clear error, not a hang; workers exit when the engine is shut down or collected, and on another "node"."""
from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.distributed import TIMEOUT_ENV, tp_size
from tokenmill.engine.tp_launcher import TensorParallelError
from tokenmill.engine.tp_worker import weight_bytes
from tokenmill.runner import model_runner

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 120 + 3 for j in range(3 + 13 * i)] for i in range(3)]  # 3, 16 and 29 tokens
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256)
CASES = {  # a GQA split over ranks; qkv bias with tied embeddings; q/k norms with one KV head on every rank
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-kv-replicated": ("Qwen3Config", dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)),
}
# paged in small blocks, prompts chunked and mixed with decodes
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, max_num_batched_tokens=16,
              kv_cache_memory=1 << 20)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Random checkpoints saved by transformers, with weights large enough to make every rank's slice matter."""
    dirs = {}
    for name, (config_cls, extra) in CASES.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**TINY, **extra)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.copy_(torch.rand(p.shape) + 0.5 if "norm" in pname else torch.randn(p.shape) * 0.08)
        dirs[name] = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(dirs[name])
    return dirs


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def share_bytes(model: torch.nn.Module, tp: int) -> int:
    """Bytes one rank should hold: 1/tp of every split tensor, all of a replicated one (norms; the K and V
    projections when there are fewer KV heads than ranks)."""
    cfg, total = model.config, 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if "norm" in name:
            total += size
        elif "qkv_proj" in name and cfg.num_key_value_heads < tp:
            kv = size * 2 * cfg.num_key_value_heads // (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
            total += (size - kv) // tp + kv
        else:
            total += size // tp
    return total


def assert_exited_cleanly(procs: list[multiprocessing.Process]) -> None:
    for p in procs:
        p.join(15)
        assert p.exitcode == 0, f"worker {p.name} ended with {p.exitcode}"
    assert tp_size() == 1


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1_on_tiny_models(case: str, tiny_dirs: dict[str, str]) -> None:
    ref = LLM(tiny_dirs[case], **ENGINE)
    want = tokens(ref, PROMPTS)
    expected_share = share_bytes(ref.llm_engine.runner.model, 2)
    total = weight_bytes(ref.llm_engine.runner)
    llm = LLM(tiny_dirs[case], tensor_parallel_size=2, **ENGINE)
    procs = list(llm.llm_engine.workers.procs.values())
    assert tokens(llm, PROMPTS) == want
    per_rank = llm.llm_engine.collective_rpc(weight_bytes)
    assert per_rank == [expected_share, expected_share] and expected_share < 0.6 * total
    with pytest.raises(RuntimeError, match="a tensor-parallel engine is running in this process"):
        LLM(tiny_dirs[case], **ENGINE)  # layers and collectives are process-wide: one engine at a time
    with pytest.raises(RuntimeError, match="built for 1 tensor-parallel rank"):
        tokens(ref, PROMPTS)
    if case == "qwen2":  # garbage collection stops the workers too
        del llm
        gc.collect()
    else:
        llm.llm_engine.shutdown()
    assert_exited_cleanly(procs)


def test_tp2_ngram_speculation_keeps_greedy_tokens(tiny_dirs: dict[str, str]) -> None:
    """Draft rows travel in the broadcast batch; verification happens on rank 0 alone."""
    repetitive = [[5, 6, 7, 8] * 6]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = tokens(LLM(tiny_dirs["llama"], **ENGINE), repetitive, params)
    llm = LLM(tiny_dirs["llama"], tensor_parallel_size=2, speculative="ngram", **ENGINE)
    assert tokens(llm, repetitive, params) == want
    assert llm.llm_engine.get_stats()["spec_num_draft_tokens"] > 0
    llm.llm_engine.shutdown()


def test_tp2_prompt_logprobs_equal_tp1(tiny_dirs: dict[str, str]) -> None:
    """Every rank runs the LM head over the prompt rows (it gathers the vocabulary across them); rank 0's
    prompt logprobs equal a single rank's, over prompts chunked by the 16-token step budget."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)

    def prompt_logprobs(llm: LLM) -> list[list[tuple[int, float, list[int]]]]:
        return [[(lp.token_id, lp.logprob, list(lp.top)) for lp in o.prompt_logprobs[1:]]
                for o in llm.generate(PROMPTS, params)]

    want = prompt_logprobs(LLM(tiny_dirs["llama"], **ENGINE))
    llm = LLM(tiny_dirs["llama"], tensor_parallel_size=2, **ENGINE)
    got = prompt_logprobs(llm)
    llm.llm_engine.shutdown()
    assert [len(g) for g in got] == [len(p) - 1 for p in PROMPTS]
    for g, w in zip(got, want):
        assert [(t, top) for t, _, top in g] == [(t, top) for t, _, top in w]
        assert [lp for _, lp, _ in g] == pytest.approx([lp for _, lp, _ in w], abs=1e-5)


def test_tp2_async_scheduling_equals_tp1(tiny_dirs: dict[str, str]) -> None:
    """Steps launched before the previous step's tokens are read back: rank 0 broadcasts the sampled tokens on
    the device and the workers feed them to the next input as rank 0 does (greedy and seeded sampling)."""
    params = [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True), GREEDY]
    want = tokens(LLM(tiny_dirs["llama"], **ENGINE), PROMPTS, params)
    llm = LLM(tiny_dirs["llama"], tensor_parallel_size=2, async_scheduling=True, **ENGINE)
    runner, launches = llm.llm_engine.runner, []
    launch = runner.launch
    runner.launch = lambda *a: launches.append(1) or launch(*a)
    assert tokens(llm, PROMPTS, params) == want
    assert len(launches) >= 10  # the decode steps went ahead
    llm.llm_engine.shutdown()


def test_default_model_tp3_equals_tp1(chat_prompt_ids: list[list[int]]) -> None:
    """SmolLM2-135M has 9 attention heads and 3 KV heads: 3 ranks is the split it allows."""
    kw = dict(dtype="float32", max_model_len=512, kv_cache_memory=32 << 20)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = LLM(**kw)
    want = tokens(ref, chat_prompt_ids[:2], params)
    expected_share, total = share_bytes(ref.llm_engine.runner.model, 3), weight_bytes(ref.llm_engine.runner)
    del ref
    llm = LLM(tensor_parallel_size=3, **kw)
    procs = list(llm.llm_engine.workers.procs.values())
    assert tokens(llm, chat_prompt_ids[:2], params) == want
    assert llm.llm_engine.collective_rpc(weight_bytes) == [expected_share] * 3
    assert expected_share < 0.34 * total
    llm.llm_engine.shutdown()
    assert_exited_cleanly(procs)


def test_size_that_does_not_split_the_model_fails_before_spawning() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not split.*9 attention heads.*"
                                         r"sizes that work: 1, 3$"):
        LLM(tensor_parallel_size=2, dtype="float32")
    assert multiprocessing.active_children() == []
    assert tp_size() == 1


@pytest.mark.parametrize("kw, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(tensor_parallel_size=2, nnodes=3), "nnodes=3 must be >= 1 and divide tensor_parallel_size=2"),
    (dict(tensor_parallel_size=4, nnodes=2, node_rank=2, master_port=29500), r"node_rank=2 must be in \[0, nnodes=2\)"),
    (dict(tensor_parallel_size=4, nnodes=2), "needs master_addr and master_port"),
    (dict(tensor_parallel_size=2, speculative="draft:self"), "needs tensor_parallel_size=1"),
])
def test_bad_parallel_options(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kw)


@pytest.mark.parametrize("when", ["between_steps", "mid_step"])
def test_killed_worker_ends_engine_with_clear_error(when: str, tiny_dirs: dict[str, str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "4")
    llm = LLM(tiny_dirs["llama"], tensor_parallel_size=2, **ENGINE)
    (proc,) = llm.llm_engine.workers.procs.values()
    assert len(tokens(llm, PROMPTS[:1])) == 1
    if when == "between_steps":  # idle for longer than any collective may wait: keepalives hold the group
        time.sleep(6)
        assert len(tokens(llm, PROMPTS[:1])) == 1

    def kill() -> None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()

    if when == "between_steps":
        kill()
    else:  # the worker has the batch; rank 0 meets its death in the forward's first collective
        broadcast = model_runner.broadcast_object

        def broadcast_then_kill(obj: object) -> None:
            broadcast(obj)
            kill()

        monkeypatch.setattr(model_runner, "broadcast_object", broadcast_then_kill)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {proc.pid}\) was killed by signal 9"):
        tokens(llm, PROMPTS)
    assert time.monotonic() - start < 4
    assert tp_size() == 1 and multiprocessing.active_children() == []
    with pytest.raises(TensorParallelError, match="was killed by signal 9"):  # and it stays failed
        tokens(llm, PROMPTS[:1])


@pytest.mark.parametrize("end", ["shutdown", "node_killed"])
def test_second_node_runs_tokenmill_worker(end: str, tiny_dirs: dict[str, str], tmp_path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two "nodes" on one machine: rank 1 comes from `tokenmill worker --node-rank 1`, rank 0 from the engine.
    Shut down, the worker command exits 0; killed, rank 0 reports the failed collective."""
    monkeypatch.setenv(TIMEOUT_ENV, "10")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "worker", *nodes, "--node-rank", "1",
                                   "--device", "cpu"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            ref = tokens(LLM(tiny_dirs["llama"], **ENGINE), PROMPTS)
            llm = LLM(tiny_dirs["llama"], tensor_parallel_size=2, nnodes=2, master_port=port, **ENGINE)
            assert llm.llm_engine.workers.procs == {}
            assert tokens(llm, PROMPTS) == ref
            if end == "shutdown":
                llm.llm_engine.shutdown()
                assert worker.wait(30) == 0, (tmp_path / "worker.log").read_text()
            else:
                os.killpg(worker.pid, signal.SIGKILL)  # the node: the command and its rank
                worker.wait()
                with pytest.raises(TensorParallelError, match="a tensor-parallel collective failed"):
                    tokens(llm, PROMPTS)
                assert tp_size() == 1
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)


def test_dummy_weights_are_the_same_model_at_any_tp() -> None:
    """Random weights are drawn whole and sliced per rank, so benchmarks and GPU checks can compare TP=2 with TP=1."""
    kw = dict(load_format="dummy", model_preset="tiny-llama", **ENGINE)
    ref = LLM(**kw)
    want = tokens(ref, PROMPTS)
    del ref
    gc.collect()
    llm = LLM(tensor_parallel_size=2, **kw)
    assert tokens(llm, PROMPTS) == want
    llm.llm_engine.shutdown()


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@two_gpus
@pytest.mark.parametrize("model", ["tiny", "llama-3-8b"])
def test_tp2_equals_tp1_on_gpus(model: str, tiny_dirs: dict[str, str]) -> None:
    """NCCL, the Triton kernels and CUDA graphs (collectives captured inside) give TP=1's greedy tokens: on a
    tiny checkpoint, and on random weights of the Llama-3-8B shape in float32."""
    if model == "tiny":
        kw, prompts = dict(model=tiny_dirs["llama"], **{**ENGINE, "kv_cache_memory": 1 << 26}), PROMPTS
    else:
        kw = dict(load_format="dummy", model_preset=model, skip_tokenizer_init=True, dtype="float32",
                  kv_cache_memory=4 << 30)
        prompts = [[(31 * i + 17 * j) % 120_000 + 5 for j in range(16 + 40 * i)] for i in range(4)]
    kw.update(device="cuda", max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref = LLM(**kw)
    want = tokens(ref, prompts, params)
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(tensor_parallel_size=2, **kw)
    assert llm.llm_engine.runner.graphs is not None
    assert tokens(llm, prompts, params) == want
    llm.llm_engine.shutdown()
    if model == "tiny":  # sampled tokens broadcast on the device, fed to the next step inside its graph
        llm = LLM(tensor_parallel_size=2, async_scheduling=True, **kw)
        assert tokens(llm, prompts, params) == want
        llm.llm_engine.shutdown()
