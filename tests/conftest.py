import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "List three primary colors.",
]


@pytest.fixture(scope="session")
def default_model_path():
    from tokenmill.model.default import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def chat_prompt_ids():
    """Token ids of a few real chat prompts, rendered with the default model's chat template."""
    from tokenmill.model.default import default_model_path
    from tokenmill.tokenizer import load_tokenizer
    tok = load_tokenizer(default_model_path())
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in CHAT_PROMPTS]
