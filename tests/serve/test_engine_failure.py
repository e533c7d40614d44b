"""A server whose engine lost its tensor-parallel group (a TensorParallelError: every later step fails the same
way) says so: /health is 503 with the error, the request in flight and every later one get a 503 in OpenAI's
shape, and the engine is never stepped again. In process: the engine's step raises as a dead rank makes it."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.tp_launcher import TensorParallelError
from tokenmill.serve.api_server import ServerConfig, build_app

DEAD = "tensor-parallel rank 1 (pid 4242) was killed by signal 9; the tensor-parallel group is gone"


def assert_unavailable(r, contains: str) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "service_unavailable" and err["code"] == "engine_unavailable"
    assert contains in err["message"], err


def test_engine_that_lost_its_group_is_unhealthy(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine.from_engine_args(max_model_len=256, kv_cache_memory=8 << 20)
    steps = []

    def dead_step() -> list:
        steps.append(1)
        raise TensorParallelError(DEAD)

    monkeypatch.setattr(engine, "step", dead_step)
    app = build_app(engine, ServerConfig(model_name="m", model_root="m"))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert_unavailable(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}), "killed by signal 9")
        assert_unavailable(client.get("/health"), DEAD)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert_unavailable(client.post("/v1/chat/completions", json=chat), "takes no more requests")
        assert_unavailable(client.post("/v1/chat/completions", json={**chat, "stream": True}), DEAD)
    assert len(steps) == 1
