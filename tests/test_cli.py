"""The console entry point's handling of bad input: a message and status 2, never a traceback."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *argv], input="hi\n", capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--model", "/nonexistent"], "model path /nonexistent does not exist; expected a Hugging Face"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--load-format", "dummy", "--model-preset", "tiny-llama"], "has no tokenizer"),
    (["chat", "--load-format", "dummy", "--model-preset", "tiny-llama"], "has no tokenizer"),
    (["generate", "hi", "--skip-tokenizer-init"], "has no tokenizer"),
    # torch's RuntimeError (or a failure later, in the model) for a device the engine does not run on
    (["generate", "hi", "--device", "tpu"], "device='tpu' is not supported; allowed: auto, cpu, cuda, cuda:N"),
    (["generate", "hi", "--device", "meta"], "device='meta' is not supported; allowed: auto, cpu, cuda, cuda:N"),
    (["generate", "hi", "--device", "mps"], "device='mps' is not supported; allowed: auto, cpu, cuda, cuda:N"),
    (["quantize", "--method", "int8", "--out", "{tmp}/q", "--device", "tpu"], "device='tpu' is not supported"),
    (["quant-eval", "--device", "meta"], "device='meta' is not supported"),
    # the error listed every accepted quantization but gguf
    (["generate", "hi", "--quantization", "int5"], "'int5' is not supported; allowed: int8, int4, int8-g<N>, "
                                                   "int4-g<N> with N in (32, 64, 128), fp8, or gguf"),
    # the planner and the simulator accepted what the engine refuses
    (["plan", "--model", "llama-3-8b", "--max-model-len", "100000"],
     "max_model_len=100000 exceeds the model's max_position_embeddings 8192"),
    (["plan", "--model", "llama-3-8b", "--block-size", "24"], "block_size must be a power of two >= 1, got 24"),
    (["plan", "--model", "llama-3-8b", "--max-model-len", "1024", "--avg-context", "100000"],
     "--avg-context 100000 exceeds max_model_len=1024"),  # was a plan of 32 requests at 100,000 tokens
    (["plan", "--model", "llama-3-8b", "--weight-dtype", "int4", "--group-size", "0"],
     "group size must be one of (32, 64, 128), got 0"),
    (["simulate", "--model", "llama-3-8b", "--max-model-len", "100000"],
     "max_model_len=100000 exceeds the model's max_position_embeddings 8192"),
    (["simulate", "--model", "llama-3-8b", "--cost-model", "{tmp}/file"], "--cost-model {tmp}/file is not JSON"),
    (["simulate", "--model", "llama-3-8b", "--num-blocks", "100", "--kv-tokens", "1600"],
     "give the KV pool one way: --num-blocks or --kv-tokens, not both"),
    # found out after minutes of quantizing or evaluating, with a traceback
    (["quantize", "--method", "int8", "--out", "{tmp}/file/q"], "output folder {tmp}/file/q cannot be created: "
                                                                 "{tmp}/file is not a folder"),
    (["quantize", "--method", "int8", "--out", "/proc/tokenmill/q"], "output folder /proc/tokenmill/q cannot be "
                                                                     "written: creating a file in /proc failed"),
    (["quant-eval", "--json", "{tmp}"], "--json {tmp} is a directory; give a file path"),
    (["quant-eval", "--plot", "{tmp}/file/kl.png"], "--plot folder {tmp}/file cannot be created"),
    (["quant-eval", "--max-tokens", "0", "--replay", "{tmp}/prompts.jsonl"], "--max-tokens must be at least 1, got 0"),
    # IsADirectoryError or RecursionError tracebacks; a missing file was a bare "[Errno 2]" naming no flag
    (["quant-eval", "--replay", "{tmp}"], "--replay {tmp} cannot be read (Is a directory); give a JSONL file"),
    (["quant-eval", "--replay", "{tmp}/missing"], "--replay {tmp}/missing cannot be read (No such file or directory)"),
    (["quant-eval", "--replay", "{tmp}/deep"], "{tmp}/deep:1: not valid JSON (nested too deep)"),
    (["simulate", "--model", "llama-3-8b", "--cost-model", "{tmp}"], "--cost-model {tmp} cannot be read (Is a "
                                                                     "directory)"),
    (["simulate", "--model", "llama-3-8b", "--cost-model", "{tmp}/deep"], "--cost-model {tmp}/deep is not JSON "
                                                                          "(nested too deep)"),
])
def test_bad_input_is_a_message_and_status_2(argv, message, tmp_path):
    (tmp_path / "file").write_text("not JSON")
    (tmp_path / "deep").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    r = _run([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert r.returncode == 2, r.stderr
    message = message.replace("{tmp}", str(tmp_path))
    assert r.stderr.startswith("tokenmill: error: ") and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--kv-cache-memory", "inf"],
    ["plan", "--memory", "inf"],
    ["plan", "--memory", "nan"],
    ["simulate", "--memory", "1e400"],
    ["plan", "--memory", "80G"],
])
def test_a_bad_size_is_argparses_error_listing_the_units(argv):
    """inf and 1e400 were an OverflowError traceback; argparse's "invalid parse_bytes value" listed no unit."""
    r = _run(argv)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tokenmill {argv[0]}: error: argument {argv[-2]}: invalid size {argv[-1]!r}"), last
    assert "KB, MB, GB, TB" in last and "KiB, MiB, GiB, TiB" in last, last


@pytest.mark.parametrize("value, message", [
    ("{tmp}/missing.jinja", "'{tmp}/missing.jinja' is neither a file nor a jinja2 template; give a template's path "
                            "or its text"),
    ("{% for m in messages %}", "--chat-template is not a valid jinja2 chat template (line 1"),
    ("{tmp}/bad.jinja", "--chat-template {tmp}/bad.jinja is not a valid jinja2 chat template (line 1"),
])
def test_a_bad_chat_template_stops_serve_before_the_model_loads(value, message, tmp_path):
    (tmp_path / "bad.jinja").write_text("{{ messages[0].content")
    r = _run(["serve", "--chat-template", value.replace("{tmp}", str(tmp_path))])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenmill serve: error: argument --chat-template: ") and \
        message.replace("{tmp}", str(tmp_path)) in last, last


@pytest.mark.parametrize("argv, message", [
    # a traceback at startup, then a backend that never answered, or a busy loop of polls
    (["router", "--backend", "notaurl:::"], "argument --backend: 'notaurl:::' is not a server's base URL"),
    (["router", "--backend", "http://127.0.0.1:99999"], "argument --backend: 'http://127.0.0.1:99999' is not"),
    (["router", "--backend", "http://127.0.0.1:8771?x=1"], "give http(s)://HOST[:PORT]"),
    (["router", "--backend", "http://127.0.0.1:8771/v1"], "no path: the router adds /v1/..."),
    (["router", "--backend", "ftp://127.0.0.1:8771"], "is not a server's base URL"),
    (["router", "--backend", "h:1", "--poll-interval", "0"], "argument --poll-interval: must be a number > 0, got '0'"),
    (["router", "--backend", "h:1", "--health-timeout", "-1"], "argument --health-timeout: must be a number > 0"),
    (["router", "--backend", "h:1", "--affinity-slack", "nan"], "argument --affinity-slack: must be a number >= 0"),
    (["router", "--backend", "h:1", "--long-prompt-threshold", "-5"], "must be an integer >= 0, got '-5'"),
    (["router", "--backend", "h:1", "--port", "70000"], "argument --port: must be a port number in [0, 65535]"),
    (["serve", "--port", "-1"], "argument --port: must be a port number in [0, 65535], got '-1'"),
    # an origin with a path or no scheme never matches a browser's Origin header
    (["serve", "--allowed-origins", "app.example.com"], "'app.example.com' is not an origin; give '*' or scheme://"),
    (["router", "--backend", "h:1", "--allowed-origins", '["https://a.example", "https://b.example/x"]'],
     "'https://b.example/x' is not an origin"),
    (["serve", "--allowed-origins", '["https://a.example"'], "is not a JSON list of origins"),
    (["serve", "--default-chat-template-kwargs", "enable_thinking=false"], "not JSON (Expecting value"),
    (["serve", "--default-chat-template-kwargs", '{"messages": []}'], "it cannot set messages"),
    # random weights were quantized (or scored) without a word, though --help lists no dummy
    (["quantize", "--method", "int8", "--out", "q", "--load-format", "dummy"], "argument --load-format: invalid choice"),
    (["quant-eval", "--load-format", "dummy"], "argument --load-format: invalid choice: 'dummy'"),
])
def test_a_bad_flag_is_argparses_error(argv, message):
    r = _run(argv)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tokenmill {argv[0]}: error: ") and message in last, last


@pytest.mark.parametrize("argv, message", [
    (["router", "--backend", "127.0.0.1:8771", "--backend", "http://127.0.0.1:8771/"],
     "each backend may be given once, in one pool; given more than once: http://127.0.0.1:8771"),
    (["router", "--backend", "h:1", "--long-backend", "h:1"], "given more than once: http://h:1"),
    (["router", "--backend", "h:1", "--max-request-bytes", "0"], "--max-request-bytes must be at least 1 byte"),
    (["serve", "--max-request-bytes", "0"], "--max-request-bytes must be at least 1 byte, got 0"),
    (["generate", "hi", "--num-speculative-tokens", "3"], "num_speculative_tokens only apply to speculative"),
    (["generate", "hi", "--model-preset", "qwen3-0.6b"], "needs load_format='dummy'"),
])
def test_a_bad_router_or_server_setting_is_a_message_and_status_2(argv, message):
    r = _run(argv)
    assert r.returncode == 2 and r.stderr.startswith("tokenmill: error: ") and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_port_in_use_is_said_before_the_model_loads():
    """uvicorn said so only after the model had loaded (minutes for a large one on a GPU)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _run(["serve", "--port", str(port), "--log-level", "info"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"tokenmill: error: cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "serving" not in r.stderr, r.stderr  # logged once the model has loaded


def test_a_kv_cache_larger_than_memory_is_a_message():
    """It was the allocator's RuntimeError and a traceback."""
    r = _run(["generate", "hi", "--max-tokens", "2", "--kv-cache-tokens", "1000000000"])  # ~43 TiB
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "tokenmill: error: the KV cache of" in r.stderr and "does not fit in the cpu memory left" in r.stderr
