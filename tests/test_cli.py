"""The console entry point's handling of bad input: a message and status 2, never a traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--model", "/nonexistent"], "model path /nonexistent does not exist; expected a Hugging Face"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--load-format", "dummy", "--model-preset", "tiny-llama"], "has no tokenizer"),
    (["chat", "--load-format", "dummy", "--model-preset", "tiny-llama"], "has no tokenizer"),
    (["generate", "hi", "--skip-tokenizer-init"], "has no tokenizer"),
])
def test_bad_input_is_a_message_and_status_2(argv, message):
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", *argv], input="hi\n", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("tokenmill: error: ") and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
