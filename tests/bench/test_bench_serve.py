"""`tokenmill bench serve`: vLLM's random dataset and arrivals, the client-side metrics, and a whole run against a
small stand-in OpenAI-compatible server."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tokenmill.bench import serve as bench
from tokenmill.cli import build_parser
from tokenmill.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return load_tokenizer(default_model_path)


def test_random_dataset_follows_vllms_draws(tokenizer):
    reqs = bench.sample_random_requests(tokenizer, 16, input_len=64, output_len=32, range_ratio=0.5, prefix_len=0,
                                        seed=7)
    rng = np.random.default_rng(7)
    input_lens = rng.integers(32, 96 + 1, size=16)  # SmolLM2 adds no special tokens: L' = L
    output_lens = rng.integers(16, 48 + 1, size=16)
    assert [r.expected_output_len for r in reqs] == output_lens.tolist()
    assert sum(r.prompt_len for r in reqs) == pytest.approx(sum(input_lens.tolist()), rel=0.05)
    for r in reqs:
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
    again = bench.sample_random_requests(tokenizer, 16, 64, 32, 0.5, 0, seed=7)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_random_dataset_fixed_lengths_and_shared_prefix(tokenizer):
    reqs = bench.sample_random_requests(tokenizer, 8, input_len=40, output_len=10, range_ratio=0.0, prefix_len=20,
                                        seed=0)
    assert all(r.expected_output_len == 10 for r in reqs)
    assert all(abs(r.prompt_len - 60) <= 2 for r in reqs)
    common = os.path.commonprefix([r.prompt for r in reqs])
    assert len(common) > 20
    specials = bench._special_ids(tokenizer)
    assert specials and all(not (set(tokenizer.encode(r.prompt, add_special_tokens=False)) & specials) for r in reqs)


@pytest.mark.parametrize("flags, match", [(["--goodput", "ttfx:500"], "goodput"),
                                          (["--metric-percentiles", "p99"], "metric-percentiles"),
                                          (["--request-rate", "0"], "request-rate"),
                                          (["--percentile-metrics", "ttft,bogus"],
                                           "--percentile-metrics: unknown 'bogus'; allowed: ttft, tpot, itl, e2el"),
                                          (["--save-result", "--result-dir", "{file}"], "is a file, not a folder")])
def test_options_read_after_the_run_are_checked_before_it(flags, match, tmp_path):
    """No server listens on port 9: the bad option is reported before any request is sent (a --result-dir that
    is a file was a FileExistsError after the whole run)."""
    (tmp_path / "file").write_text("")
    flags = [f.replace("{file}", str(tmp_path / "file")) for f in flags]
    ns = build_parser().parse_args(["bench", "serve", "--port", "9", *flags])
    with pytest.raises(ValueError, match=match):
        bench.run(ns)


def test_no_server_is_a_clear_error():
    """A port nothing listens on used to end in httpx's ConnectError traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ns = build_parser().parse_args(["bench", "serve", "--port", str(port), "--num-prompts", "1", "--disable-tqdm"])
    with pytest.raises(ValueError, match=rf"cannot list the models of http://127\.0\.0\.1:{port} \(ConnectError: "
                                         r".*start a server \(tokenmill serve\)"):
        bench.run(ns)


def test_a_failing_first_request_is_a_clear_error(fake_server):
    ns = build_parser().parse_args(["bench", "serve", "--base-url", fake_server, "--endpoint", "/v1/nowhere",
                                    "--num-prompts", "1", "--disable-tqdm"])
    with pytest.raises(ValueError, match=rf"initial test run against {fake_server}/v1/nowhere failed.*404"):
        bench.run(ns)


@pytest.mark.parametrize("flags, match", [
    (["--num-prompts", "0"], "--num-prompts must be at least 1, got 0"),           # hung: a pool of 0 connections
    (["--seed", "-1"], "--seed must be at least 0, got -1"),                       # numpy's "Seed must be between"
    (["--max-concurrency", "0"], "--max-concurrency must be at least 1, got 0"),   # silently unlimited
    (["--random-output-len", "0"], "--random-output-len must be at least 1, got 0"),   # silently 1
    (["--random-prefix-len", "-1"], "--random-prefix-len must be at least 0, got -1"),
    (["--burstiness", "nan"], "--burstiness must be > 0"),                         # NaN send times
])
def test_counts_out_of_range_are_refused_before_the_run(flags, match):
    ns = build_parser().parse_args(["bench", "serve", "--port", "9", *flags])
    with pytest.raises(ValueError, match=match):
        bench.check_args(ns)


def test_arrival_delays():
    assert bench.arrival_delays(5, float("inf"), 1.0) == [0.0] * 5
    np.random.seed(0)
    d = bench.arrival_delays(100, 4.0, 1.0)
    assert d[-1] == pytest.approx(25.0) and all(b >= a for a, b in zip(d, d[1:]))
    np.random.seed(0)
    assert bench.arrival_delays(100, 4.0, 1.0) == d
    assert bench.arrival_delays(4, 2.0, float("inf")) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError):
        bench.arrival_delays(3, 1.0, 0.0)


def test_metrics_and_goodput(tokenizer):
    outs = [bench.RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5,
                                itl=[0.1, 0.1, 0.1, 0.1]),
            bench.RequestResult(success=True, prompt_len=10, output_tokens=3, ttft=0.4, latency=0.6, itl=[0.1, 0.1]),
            bench.RequestResult(success=False, error="boom")]
    m, lens = bench.calculate_metrics(outs, 2.0, tokenizer, [50, 99], bench.parse_goodput(["ttft:200", "tpot:150"]))
    assert lens == [5, 3, 0] and m["completed"] == 2 and m["failed"] == 1
    assert m["tpot"]["mean"] == pytest.approx(100.0)
    assert m["ttft"]["median"] == pytest.approx(250.0)
    assert m["request_goodput"] == pytest.approx(0.5)  # only the first meets ttft <= 200 ms
    assert m["output_throughput"] == pytest.approx(4.0) and m["total_token_throughput"] == pytest.approx(14.0)
    with pytest.raises(ValueError):
        bench.parse_goodput(["latency:5"])


# ---- a whole run against a stand-in server -------------------------------------------------------------
def fake_openai_app() -> FastAPI:
    """Streams five one-word chunks, 10 ms apart, then usage, for completions and chat alike."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def events(chat: bool, body: dict):
        for i in range(5):
            await asyncio.sleep(0.01)
            choice = {"index": 0, "delta": {"content": f"w{i} "}} if chat else {"index": 0, "text": f"w{i} "}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 7, 'completion_tokens': 5}})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 4
        return StreamingResponse(events(False, body), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        assert body["messages"][0]["role"] == "user" and body["max_completion_tokens"] == 4
        return StreamingResponse(events(True, body), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake_openai_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_run_against_any_openai_server(fake_server, tmp_path, backend, capsys):
    ns = build_parser().parse_args([
        "bench", "serve", "--base-url", fake_server, "--backend", backend, "--num-prompts", "6",
        "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos", "--request-rate", "50",
        "--max-concurrency", "3", "--goodput", "ttft:1000", "tpot:1000", "--save-result", "--result-dir",
        str(tmp_path), "--result-filename", "r.json", "--plot", "--disable-tqdm"])
    result = ns.func(ns)
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99 TTFT (ms):" in out and "P90 ITL (ms):" in out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 6 and saved["failed"] == 0 and saved["model_id"] == "fake-model"
    assert saved["total_output_tokens"] == 30 and saved["total_input_tokens"] == 42
    assert saved["request_goodput"] == pytest.approx(saved["request_throughput"])
    assert all(len(itl) == 4 for itl in saved["itls"]) and saved["mean_ttft_ms"] >= 10
    assert result["p99_e2el_ms"] == saved["p99_e2el_ms"]
    assert (tmp_path / "r.png").stat().st_size > 0
