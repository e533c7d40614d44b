"""The server's sampling defaults come from the model (--generation-config, vLLM's rules): a request's unset
fields take them and its own values win; the model's max_new_tokens is the default of an unset max_tokens, the
operator's (--override-generation-config) caps every request's."""
from __future__ import annotations

import json

import openai
import pytest
from serve_helpers import Server

PROMPT = "Count from one to twenty: one, two, three,"
MESSAGES = [{"role": "user", "content": PROMPT}]
EOS_OFF = {"ignore_eos": True}


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def overridden():
    s = Server("--max-model-len", "1024", "--override-generation-config", '{"temperature": 0, "max_new_tokens": 5}')
    yield _client(s)
    s.stop()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, default_model_path):
    """A small random model whose folder holds a generation_config.json, with the default model's tokenizer."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("gen_model")
    transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                             architectures=["LlamaForCausalLM"],
                             ).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7, "temperature": 0.0}))
    s = Server("--model", str(folder), "--load-format", "dummy", "--tokenizer", default_model_path)
    yield _client(s)
    s.stop()


def test_the_operators_max_new_tokens_caps_every_request(overridden):
    model = overridden.models.list().data[0].id
    done = overridden.completions.create(model=model, prompt=PROMPT, extra_body=EOS_OFF)
    assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
    chat = overridden.chat.completions.create(model=model, messages=MESSAGES, extra_body=EOS_OFF)
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    own = overridden.completions.create(model=model, prompt=PROMPT, max_tokens=9, extra_body=EOS_OFF)
    assert own.usage.completion_tokens == 5


def test_unset_temperature_takes_the_default_and_a_requests_own_wins(overridden):
    model = overridden.models.list().data[0].id
    greedy = overridden.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0,
                                           extra_body=EOS_OFF).choices[0].text
    unset = overridden.completions.create(model=model, prompt=PROMPT, n=4, seed=1, extra_body=EOS_OFF)
    assert [c.text for c in unset.choices] == [greedy] * 4  # temperature 0 from the defaults: every sample greedy
    hot = overridden.completions.create(model=model, prompt=PROMPT, n=4, seed=1, temperature=1.5,
                                        extra_body=EOS_OFF)
    assert any(c.text != greedy for c in hot.choices)


def test_the_models_own_max_new_tokens_is_only_a_default(model_folder):
    model = model_folder.models.list().data[0].id
    chat = model_folder.chat.completions.create(model=model, messages=MESSAGES, extra_body=EOS_OFF)
    assert chat.usage.completion_tokens == 7
    own = model_folder.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=9,
                                               extra_body=EOS_OFF)
    assert own.usage.completion_tokens == 9
    done = model_folder.completions.create(model=model, prompt=PROMPT, extra_body=EOS_OFF)
    assert done.usage.completion_tokens == 16  # OpenAI's default is set, so the model's does not apply
    a, b = (model_folder.completions.create(model=model, prompt=PROMPT, max_tokens=6, seed=s, extra_body=EOS_OFF)
            for s in (1, 2))
    assert a.choices[0].text == b.choices[0].text  # the model's temperature 0: greedy whatever the seed
