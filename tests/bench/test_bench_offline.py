"""`tokenmill bench latency | throughput | ablation | compare-hf` run end to end on the CPU in tiny configurations
(random tiny-llama weights, a few requests), writing JSON whose figures must be present and positive; plus the
pieces whose exactness matters: the nano-vllm draw, the recompute path, sweep parsing, weight bytes, kernel choice."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from tokenmill.bench import sweep
from tokenmill.bench.ablation import recompute_generate
from tokenmill.bench.common import build_engine, generate, weight_bytes
from tokenmill.bench.parts import PART_NAMES, skip_parts
from tokenmill.bench.sweep import parse_sweep
from tokenmill.bench.throughput import step_breakdown, triton_compiles
from tokenmill.bench.workloads import nano_vllm_workload
from tokenmill.cli import main
from tokenmill.config import EngineArgs
from tokenmill.kernels import get_ops, torch_ref
from tokenmill.sampling_params import SamplingParams

TINY = ["--load-format", "dummy", "--model-preset", "tiny-llama"]


def run_bench(tmp_path, *argv: str) -> dict:
    out = tmp_path / "result.json"
    main(["bench", *argv, *TINY, "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["env"]["date"] and result["env"]["hardware"]
    assert result["engine_args"]["model_preset"] == "tiny-llama"
    return result


def assert_positive(row: dict, *keys: str) -> None:
    for key in keys:
        assert row[key] > 0, (key, row)


def test_latency(tmp_path):
    result = run_bench(tmp_path, "latency", "--output-len", "8", "--prefill-len", "32", "--num-iters", "2")
    (row,) = result["results"]
    assert_positive(row, "decode_tokens_per_s", "decode_ms_per_token", "prefill_tokens_per_s", "weight_bytes",
                    "weight_bytes_read_per_token", "bandwidth_gb_per_s")
    assert len(row["decode_tokens_per_s_all"]) == 2 and row["prefill_len"] == 32


def test_throughput_with_sweep(tmp_path):
    result = run_bench(tmp_path, "throughput", "--num-requests", "4", "--max-input-len", "8", "--max-output-len", "6",
                       "--sweep", "block_size=8,16", "max-num-seqs=2")
    rows = result["results"]
    assert [(r["block_size"], r["max_num_seqs"], r["temperature"]) for r in rows] == [
        (8, 2, 0.6), (8, 2, 0.0), (16, 2, 0.6), (16, 2, 0.0)]
    # the header holds the options as given (block_size 16, max_num_seqs 256), not the first combination's
    assert (result["engine_args"]["block_size"], result["engine_args"]["max_num_seqs"]) == (16, 256)
    expected = nano_vllm_workload(4, 8, 6, vocab_size=256).num_output_tokens
    for row in rows:
        assert row["output_tokens"] == expected
        assert_positive(row, "elapsed_s", "output_tokens_per_s", "total_tokens_per_s", "requests_per_s")
        assert row["total_tokens_per_s"] > row["output_tokens_per_s"]
        phases = {b["phase"]: b for b in row["breakdown"]}
        assert phases["prefill steps"]["steps"] >= 1 and phases["decode, batch 1-8"]["steps"] >= 1
        assert sum(b["seconds"] for b in phases.values()) <= row["elapsed_s"]
        assert sum(b["share"] for b in phases.values()) == pytest.approx(1.0)
        assert row["triton_compiles"] == []  # the CPU kernels are torch's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles for a GPU")
def test_triton_compiles_records_first_uses_only():
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n):
        offs = tl.arange(0, 16)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.zeros(16, device="cuda")
    with triton_compiles() as first:
        add_one[(1,)](x, 16)
    with triton_compiles() as again:
        add_one[(1,)](x, 16)
    with triton_compiles() as new_specialization:
        add_one[(1,)](x, 7)  # 16 is specialized as divisible by 16, 7 is not
    assert again == [] and len(first) == 1 and len(new_specialization) == 1
    assert first[0].split("(")[0].endswith("add_one") and "n%16" in first[0] and "n%16" not in new_specialization[0]
    assert x[:7].tolist() == [3.0] * 7 and x[7:].tolist() == [2.0] * 9


def test_step_breakdown_groups_steps_by_phase_and_batch():
    steps = [(100, 0, 0.5), (50, 3, 0.2), (0, 1, 0.01), (0, 8, 0.03), (0, 9, 0.04), (0, 300, 0.12), (0, 0, 0.1)]
    rows = step_breakdown(steps)
    assert [(r["phase"], r["steps"]) for r in rows] == [
        ("prefill steps", 2), ("decode, batch 1-8", 2), ("decode, batch 9-32", 1), ("decode, batch > 256", 1),
        ("read back only", 1)]
    prefill, small = rows[0], rows[1]
    assert prefill["seconds"] == pytest.approx(0.7) and prefill["share"] == pytest.approx(0.7)
    assert small["ms_per_step"] == pytest.approx(20.0) and small["decode_tokens_per_s"] == pytest.approx(9 / 0.04)


def test_ablation(tmp_path):
    result = run_bench(tmp_path, "ablation", "--num-requests", "4", "--max-input-len", "8", "--max-output-len", "6",
                       "--max-num-seqs", "2", "--naive-requests", "2", "--naive-max-tokens", "4")
    rows = {r["step"]: r for r in result["results"]}
    measured = ["recompute, no KV cache", "KV cache, static batching", "continuous batching"]
    assert list(rows)[:3] == measured
    for name in measured:
        assert_positive(rows[name], "output_tokens", "elapsed_s", "output_tokens_per_s", "gain_vs_previous",
                        "gain_vs_first")
    assert rows[measured[0]]["output_tokens"] == 8  # 2 requests x 4 tokens
    assert rows[measured[1]]["output_tokens"] == rows[measured[2]]["output_tokens"]
    for name in ("fused Triton kernels", "CUDA graphs", "quantization"):  # CPU: skipped, with the reason
        assert rows[name]["note"].startswith("skipped") and "output_tokens_per_s" not in rows[name]


def test_compare_hf(tmp_path):
    pytest.importorskip("transformers")
    result = run_bench(tmp_path, "compare-hf", "--batch-sizes", "1", "2", "--hf-dtypes", "float32",
                       "--max-tokens", "4", "--repeats", "1", "--prompt-len", "8")
    rows = result["results"]
    assert [(r["system"], r["batch_size"]) for r in rows] == [
        ("tokenmill", 1), ("tokenmill", 2), ("transformers", 1), ("transformers", 2)]
    for row in rows:
        assert_positive(row, "output_tokens_per_s")
    assert [(r["hf_dtype"], r["batch_size"]) for r in result["ratios"]] == [("float32", 1), ("float32", 2)]
    assert all(r["ratio"] > 0 for r in result["ratios"])


def test_throughput_with_the_transformers_baseline(tmp_path):
    """--hf-requests N: the first N requests through transformers' continuous batching and through tokenmill, each
    request to its own max_tokens (EOS ignored), at every temperature; the full workload's rows unchanged."""
    pytest.importorskip("transformers")
    result = run_bench(tmp_path, "throughput", "--num-requests", "5", "--max-input-len", "12", "--min-input-len",
                       "4", "--max-output-len", "9", "--min-output-len", "2", "--hf-requests", "3",
                       "--temperatures", "0.6", "0")
    rows = result["results"]
    assert [(r["system"], r["num_requests"], r["temperature"]) for r in rows] == [
        ("tokenmill", 5, 0.6), ("tokenmill", 5, 0.0), ("tokenmill", 3, 0.6), ("tokenmill", 3, 0.0),
        ("transformers", 3, 0.6), ("transformers", 3, 0.0)]
    workload = nano_vllm_workload(5, 12, 9, 4, 2, vocab_size=256)
    subset_tokens = sum(workload.max_tokens[:3])
    assert subset_tokens < workload.num_output_tokens
    for row in rows:
        expected = workload.num_output_tokens if row["num_requests"] == 5 else subset_tokens
        assert row["output_tokens"] == expected, row
        assert row["input_tokens"] == sum(len(p) for p in workload.prompts[:row["num_requests"]])
        assert_positive(row, "elapsed_s", "output_tokens_per_s")
    hf = rows[-1]
    assert hf["dtype"] == "float32" and hf["attn_implementation"]  # the kernels transformers chose for its cache
    assert result["params"]["hf_requests"] == 3


def test_nano_vllm_workload_is_nano_vllms():
    w = nano_vllm_workload()
    assert len(w.prompts) == 256 and w.num_output_tokens == 133_966
    assert all(100 <= len(p) <= 1024 and max(p) <= 10000 for p in w.prompts)


def test_recompute_matches_the_kv_cache_engine():
    engine = build_engine(EngineArgs(load_format="dummy", model_preset="tiny-llama"))
    prompts = [[5, 9, 17, 3, 200, 41, 7], [11, 2, 99]]
    cached = [o.outputs[0].token_ids for o in generate(
        engine, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    assert recompute_generate(engine, prompts, [12, 12], temperature=0.0) == cached


def test_parse_sweep():
    assert parse_sweep(None) == [{}]
    assert parse_sweep(["block_size=16,32", "--enable-prefix-caching=false", "timeout_s=none"]) == [
        {"block_size": 16, "enable_prefix_caching": False, "timeout_s": None},
        {"block_size": 32, "enable_prefix_caching": False, "timeout_s": None}]
    with pytest.raises(ValueError, match="not an engine option"):
        parse_sweep(["block_sizes=16"])
    with pytest.raises(ValueError, match="OPTION=V1"):
        parse_sweep(["block_size"])
    assert parse_sweep(["kv_cache_memory=1MiB,2GB"]) == [{"kv_cache_memory": 1 << 20}, {"kv_cache_memory": 2 * 10**9}]
    with pytest.raises(ValueError, match="--sweep block_size: '' is not a valid int"):
        parse_sweep(["block_size=16,"])
    with pytest.raises(ValueError, match="names block_size twice"):  # the last one alone counted
        parse_sweep(["block_size=8", "max_num_seqs=2", "block-size=16"])


def test_repeated_sweep_options_add_their_axes():
    """`--sweep a=... --sweep b=...` is the grid of both (argparse kept the last --sweep alone)."""
    p = argparse.ArgumentParser()
    sweep.add_sweep_arg(p)
    ns = p.parse_args(["--sweep", "block_size=8,16", "--sweep", "max_num_seqs=2", "enforce_eager=true"])
    assert parse_sweep(ns.sweep) == [{"block_size": 8, "max_num_seqs": 2, "enforce_eager": True},
                                     {"block_size": 16, "max_num_seqs": 2, "enforce_eager": True}]


def test_sweep_values_are_checked_before_the_first_row_runs(monkeypatch):
    monkeypatch.setattr(sweep, "build_engine", lambda *a: pytest.fail("an engine was built"))
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        main(["bench", "latency", *TINY, "--sweep", "block_size=16,24"])


def test_out_that_cannot_be_written_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "build_engine", lambda *a: pytest.fail("an engine was built"))
    with pytest.raises(SystemExit) as e:
        main(["bench", "latency", *TINY, "--out", str(tmp_path)])
    assert e.value.code == 2 and f"argument --out: {tmp_path} is a directory" in capsys.readouterr().err


def test_weight_bytes_counts_one_embedding_row():
    engine = build_engine(EngineArgs(load_format="dummy", model_preset="tiny-llama"))
    total, read = weight_bytes(engine.runner.model)
    assert total == 4 * sum(p.numel() for p in engine.runner.model.parameters())
    assert total - read == 4 * (256 - 1) * 64  # untied: the embedding table minus the one row a token reads


def test_kernel_backend_env(monkeypatch):
    monkeypatch.setenv("TOKENMILL_KERNELS", "torch")
    assert get_ops(torch.device("cuda")).paged_attention is torch_ref.paged_attention
    monkeypatch.setenv("TOKENMILL_KERNELS", "cuda")
    with pytest.raises(ValueError, match="TOKENMILL_KERNELS"):
        get_ops("cpu")


def test_profile(tmp_path) -> None:
    """Host phases nest inside the step, every profiled step is timed, a prefill step is cut into requests of the
    input length, and a verify forward of more query tokens is reported against the one-token forward."""
    r = run_bench(tmp_path, "profile", "--batch-sizes", "1", "3", "--num-steps", "4", "--input-len", "10",
                  "--prefill-tokens", "25", "--verify-context", "40", "--verify-query-lens", "1", "3")
    assert r["prefill"]["num_tokens"] == 25 and r["prefill"]["requests"] == 3 and r["prefill"]["wall_ms"] > 0
    assert [row["batch_size"] for row in r["decode"]] == [1, 3]
    for row in r["decode"]:
        assert 0 < row["forward_ms"] < row["execute_ms"] <= row["step_ms"] <= row["wall_ms"] * 1.01
        assert 0 < row["schedule_ms"] < row["step_ms"] and row["prepare_input_ms"] < row["execute_ms"]
    assert [v["query_len"] for v in r["verify"]] == [1, 3] and r["verify"][0]["x_one_token"] == 1.0
    assert all(v["ms"] > 0 for v in r["verify"])


SMALL = ["--max-input-len", "8", "--max-output-len", "4"]   # keeps a run short where a bad count was accepted


@pytest.mark.parametrize("argv, match", [
    (["latency", "--num-iters", "0"], "--num-iters must be at least 1, got 0"),           # IndexError in median
    (["latency", "--num-warmup", "-1"], "--num-warmup must be at least 0, got -1"),
    (["latency", "--output-len", "1"], "--output-len must be at least 2, got 1"),         # after the warm-up
    (["throughput", "--num-requests", "0", *SMALL], "--num-requests must be at least 1, got 0"),   # a row of 0s
    (["throughput", "--min-output-len", "0", *SMALL], "--min-output-len must be at least 1, got 0"),
    (["throughput", "--temperatures", "0.6", "-1", *SMALL], "--temperatures: temperature"),  # after the warm-up
    (["ablation", "--temperature", "nan", *SMALL], "--temperature: temperature"),
    (["ablation", "--naive-requests", "0", *SMALL], "--naive-requests must be at least 1, got 0"),  # max() of []
    (["multiturn", "--num-turns", "0"], "--num-turns must be at least 1, got 0"),         # ZeroDivisionError
    (["multiturn", "--num-conversations", "-1"], "--num-conversations must be at least 1, got -1"),
    (["profile", "--num-steps", "0"], "--num-steps must be at least 1, got 0"),           # ZeroDivisionError
    (["profile", "--batch-sizes", "0"], "--batch-sizes must be at least 1, got 0"),       # an empty profile
    (["profile", "--verify-context", "0"], "--verify-context must be at least 1, got 0"),  # IndexError in torch
    (["profile", "--verify-query-lens", "0"], "--verify-query-lens must be at least 1, got 0"),   # RuntimeError
    (["profile", "--verify-context", "4", "--verify-query-lens", "1", "8"], "at most --verify-context"),
    (["profile", "--batch-sizes", "4", "--max-num-seqs", "2", "--num-steps", "2", "--input-len", "4",
      "--verify-query-lens"], "--batch-sizes must be at most --max-num-seqs"),  # timed at 2, labelled 4
    (["profile", "--prefill-tokens", "5000", "--max-num-batched-tokens", "4096"],
     "--prefill-tokens must be at most --max-num-batched-tokens"),  # several steps, labelled one
    (["profile", "--prefill-tokens", "40", "--input-len", "10", "--max-num-seqs", "3", "--batch-sizes", "1"],
     "needs 4 requests; --max-num-seqs is 3"),
    (["compare-hf", "--repeats", "0"], "--repeats must be at least 1, got 0"),            # IndexError in median
    (["throughput", "--num-requests", "4", "--hf-requests", "5"], "at most --num-requests"),  # a smaller baseline
    (["throughput", "--hf-requests", "-1"], "--hf-requests must be at least 0, got -1"),
    (["latency", "--num-gpu-blocks-override", "-1"], "num_gpu_blocks_override must be >= 2"),     # RuntimeError
    (["latency", "--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),         # "KV budget holds 1"
    (["latency", "--max-model-len", "-1"], "max_model_len must be an integer >= 1"),      # "KV budget holds 1"
    (["parts", "--rounds", "0"], "--rounds must be at least 1, got 0"),                   # an empty median
    (["parts", "--skip", "none", "o+mlp"], r"--skip o\+mlp: unknown part\(s\) mlp; known: none, attention"),
])
def test_bad_counts_are_refused_before_an_engine_is_built(argv, match):
    with pytest.raises(ValueError, match=match):
        main(["bench", *argv, *TINY])


def test_parts(tmp_path):
    """Every variant is timed; skipping a part changes the model's text and leaving the block restores it."""
    result = run_bench(tmp_path, "parts", "--output-len", "4", "--num-iters", "1", "--rounds", "1", "--skip", "none",
                       "o", "attention+norms+silu_and_mul", "qkv+gate_up+down")
    rows = result["results"]
    assert [r["skipped"] for r in rows] == ["none", "o", "attention+norms+silu_and_mul", "qkv+gate_up+down"]
    for row in rows:
        assert_positive(row, "decode_tokens_per_s", "decode_ms_per_token")
        assert len(row["decode_tokens_per_s_all"]) == 1
    assert rows[0]["us_per_layer_saved"] == 0


def test_skip_parts_changes_the_text_and_restores_it():
    engine = build_engine(EngineArgs(load_format="dummy", model_preset="tiny-llama"))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    text = lambda: generate(engine, [[5, 9, 13, 7]], params)[0].outputs[0].token_ids  # noqa: E731
    before = text()
    for part in PART_NAMES:
        with skip_parts(engine.runner.model, [part]):
            assert text() != before, part
        assert text() == before, part
    with pytest.raises(ValueError, match="unknown part.*attn.*known: attention"):
        with skip_parts(engine.runner.model, ["attn"]):
            pass
