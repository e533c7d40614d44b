"""The router's own GET routes as the server has them: /v1/models/{id} (client.models.retrieve) answered from the
healthy backends' models, an id none serves being the server's 404, and HEAD answered as GET without the body. The
router runs over a session backend and a server serving another model under a name that is a path."""
from __future__ import annotations

import httpx
import openai
import pytest
from router_helpers import SERVER_ARGS, Proc, start_router

NAMED = "org/tiny-chat"


@pytest.fixture(scope="module")
def named():
    server = Proc("serve", *SERVER_ARGS, "--served-model-name", NAMED).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def router(backends, named):
    r = start_router("--backend", backends[0].url, "--backend", named.url, "--allowed-origins", "http://app.example")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_retrieve_a_model_through_the_router(router, client, model_name, named):
    """Each model is its entry of the router's list, whichever backend serves it; it was a 404 "no route". A name
    that is a path works as OpenAI's client sends it (/ as %2F) and as sent raw."""
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert sorted(listed) == sorted([model_name, NAMED])
    for model in listed:
        assert client.models.retrieve(model).model_dump() == listed[model]
    assert httpx.get(f"{router.url}/v1/models/{NAMED}").json() == httpx.get(f"{named.url}/v1/models/{NAMED}").json()


def test_a_model_no_backend_serves_is_the_servers_404(router, client, model_name, backends):
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = httpx.get(router.url + "/v1/models/gpt-4")
    served = f"{model_name!r}, {NAMED!r}"  # in the order of the router's --backend options
    own = httpx.get(backends[0].url + "/v1/models/gpt-4")
    assert r.status_code == own.status_code == 404
    assert r.json()["error"] == {**own.json()["error"],
                                 "message": f"the model 'gpt-4' does not exist; the healthy backends serve {served}"}
    assert httpx.get(router.url + "/v1/models/org").status_code == 404  # a path's first part is no model


@pytest.mark.parametrize("path, status", [("/health", 200), ("/v1/models", 200), ("/v1/models/{model}", 200),
                                          ("/v1/models/gpt-4", 404), ("/metrics", 200)])
def test_head_answers_as_get_without_the_body(router, model_name, path, status):
    """Load balancers and uptime checks probe with HEAD, which the router answered with 405 on every GET route."""
    url = router.url + path.format(model=model_name)
    get, head = httpx.get(url), httpx.head(url)
    assert head.status_code == get.status_code == status
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    if path != "/metrics":  # its values may move between the two requests
        assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_goes_to_a_backend_that_serves_its_model(router, model_name, path):
    """Backends serving different models: a request naming one goes to a backend that serves it (it went by load
    and key alone, and about half came back 404 model_not_found); one naming none goes anywhere; one naming a model
    no backend serves gets a backend's own 404."""
    body = {"max_tokens": 1, **({"prompt": "Hi"} if path == "/v1/completions" else
                                {"messages": [{"role": "user", "content": "Hi"}]})}
    for i in range(6):  # other prompts: other affinity keys, so both backends would be picked
        varied = {**body, "prompt": f"Hi {i}"} if "prompt" in body else \
            {**body, "messages": [{"role": "user", "content": f"Hi {i}"}]}
        for model in (NAMED, model_name):
            r = httpx.post(router.url + path, json={**varied, "model": model}, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == model, r.text
        assert httpx.post(router.url + path, json=varied, timeout=60).status_code == 200
    r = httpx.post(router.url + path, json={**body, "model": "gpt-4"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_cors_for_allowed_origins(router, model_name):
    """--allowed-origins on the router: its preflight answered, its own and its proxied answers naming the origin
    (the backends have no such flag); another origin gets no CORS headers."""
    origin = {"Origin": "http://app.example"}
    r = httpx.options(router.url + "/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example", r.text
    assert httpx.get(router.url + "/v1/models", headers=origin).headers["access-control-allow-origin"] == \
        "http://app.example"
    r = httpx.post(router.url + "/v1/completions", headers=origin, timeout=60,
                   json={"model": model_name, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example", r.text
    r = httpx.get(router.url + "/v1/models", headers={"Origin": "http://other.example"})
    assert "access-control-allow-origin" not in r.headers


def test_backends_that_need_a_key_are_routed_by_model_with_the_routers_key(backends, model_name):
    """A backend started with --api-key refused the router's /v1/models, so it counted as serving every model and
    got about half the requests naming another; with --backend-api-key the router knows what it serves."""
    keyed = Proc("serve", *SERVER_ARGS, "--served-model-name", "keyed", "--api-key", "k3y").wait_ready()
    router = start_router("--backend", backends[0].url, "--backend", keyed.url, "--backend-api-key", "k3y")
    try:
        auth = {"Authorization": "Bearer k3y"}
        assert sorted(m["id"] for m in httpx.get(router.url + "/v1/models", headers=auth).json()["data"]) == \
            sorted([model_name, "keyed"])
        for i in range(6):  # other prompts: other affinity keys, so both backends would be picked
            for model in (model_name, "keyed"):
                r = httpx.post(router.url + "/v1/completions", headers=auth, timeout=60,
                               json={"model": model, "prompt": f"Hi {i}", "max_tokens": 1})
                assert r.status_code == 200 and r.json()["model"] == model, r.text
    finally:
        router.stop()
        keyed.stop()
