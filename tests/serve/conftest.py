"""Fixtures of the server tests. One default server is shared by the whole session; tests that need other options
start their own."""
from __future__ import annotations

import openai
import pytest
from serve_helpers import Server

# A small context keeps "prompt too long" cheap; everything else is the default engine.
DEFAULT_ARGS = ["--max-model-len", "1024"]


@pytest.fixture(scope="session")
def server():
    s = Server(*DEFAULT_ARGS)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(client):
    return client.models.list().data[0].id
