"""The router's FastAPI app: generation and tokenizer requests are routed to a backend and proxied; /v1/models,
/v1/models/{id}, /health and /metrics answer for the router itself (HEAD too). The app owns the backends' health
polls."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.router.backend import Backend
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import Router, route_info
from tokenmill.router.proxy import Unreachable, forward, unavailable
from tokenmill.serve.errors import error_response, install_error_handlers
from tokenmill.serve.middleware import GatewayMiddleware, allow_origins, answer_head

ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize")


@dataclass
class RouterConfig:
    backends: list[str]
    long_backends: list[str]
    long_prompt_threshold: int = 1024  # estimated prompt tokens
    affinity_slack: float = 4.0        # load units
    poll_interval: float = 0.5         # seconds
    health_timeout: float = 2.0        # seconds; also the connect timeout of proxied requests
    max_request_bytes: int = 16 << 20  # larger bodies get 413 before the router reads them whole
    backend_api_key: str | None = None  # the backends' --api-key, for the router's own /v1/models requests
    allowed_origins: list[str] = field(default_factory=list)  # CORS (middleware.allow_origins)


def build_app(config: RouterConfig) -> FastAPI:
    key = config.backend_api_key
    router = Router([Backend(u, "short", key) for u in config.backends],
                    [Backend(u, "long", key) for u in config.long_backends], config.long_prompt_threshold,
                    config.affinity_slack)
    metrics = RouterMetrics(router.backends)
    # no read timeout: a generation takes as long as it takes, and a dead backend is caught by the health check;
    # idle connections are dropped before a backend's (uvicorn's 5 s keep-alive), so no request goes out on one
    # the backend is closing, which would read as a lost backend
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=config.health_timeout),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                   keepalive_expiry=4.0))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await asyncio.gather(*(b.poll(client, config.health_timeout) for b in router.backends))
        polls = [asyncio.create_task(b.poll_forever(client, config.poll_interval, config.health_timeout))
                 for b in router.backends]
        yield
        for p in polls:
            p.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        for b in router.backends:
            b.close()
        await client.aclose()

    app = FastAPI(title="tokenmill router", version=__version__, lifespan=lifespan,
                  description="An OpenAI-compatible front over several tokenmill servers.")
    app.state.router = router
    install_error_handlers(app)

    async def route(request: Request) -> Response:
        """Proxied to the backend the policy picks; a backend that refuses the connection is skipped for another."""
        body = await request.body()
        info = route_info(request.url.path, body)
        tried: set[Backend] = set()
        while (choice := router.pick(info, tried)) is not None:
            metrics.routed(choice.backend, choice.policy)
            try:
                return await forward(client, choice.backend, request, body, metrics)
            except Unreachable:
                tried.add(choice.backend)
        metrics.unroutable.inc()
        return unavailable("no healthy backend can take the request")

    for path in ROUTED_PATHS:
        app.add_api_route(path, route, methods=["POST"], tags=["routed"])

    async def backend_models(request: Request) -> dict[str, Any] | Response:
        """The models of the healthy backends by id, each once (the first backend's entry), or the answer to give
        instead; the client's credentials go to the backends."""
        auth = {k: v for k, v in request.headers.items() if k == "authorization"}
        healthy = [b for b in router.backends if b.healthy]
        answers = await asyncio.gather(*(client.get(b.url + "/v1/models", headers=auth,
                                                                  timeout=config.health_timeout) for b in healthy),
                                       return_exceptions=True)
        replies = [a for a in answers if isinstance(a, httpx.Response)]
        if not any(r.status_code == 200 for r in replies):
            if replies:  # e.g. 401 from every backend: theirs is the answer
                return Response(replies[0].content, status_code=replies[0].status_code,
                                media_type=replies[0].headers.get("content-type"))
            return unavailable("no healthy backend to list models")
        models: dict[str, Any] = {}
        for r in replies:
            if r.status_code == 200:
                for m in r.json().get("data", []):
                    models.setdefault(m["id"], m)
        return models

    @app.get("/v1/models", tags=["openai"])
    async def list_models(request: Request) -> Response:
        """The models of the healthy backends, each once."""
        models = await backend_models(request)
        if isinstance(models, Response):
            return models
        return JSONResponse({"object": "list", "data": list(models.values())})

    # :path, as the server's: a served name is often a path ("org/name"; OpenAI's client sends its / as %2F)
    @app.get("/v1/models/{model_id:path}", tags=["openai"])
    async def retrieve_model(model_id: str, request: Request) -> Response:
        """The model's entry of /v1/models, so that client.models.retrieve agrees with client.models.list; an id
        no healthy backend serves is the server's 404."""
        models = await backend_models(request)
        if isinstance(models, Response):
            return models
        if model_id not in models:
            served = ", ".join(repr(m) for m in models)
            return error_response(404, f"the model {model_id!r} does not exist; the healthy backends serve {served}",
                                  "model", "model_not_found")
        return JSONResponse(models[model_id])

    @app.get("/health", tags=["server"])
    async def health() -> Response:
        """200 while at least one backend takes requests."""
        if any(b.healthy for b in router.backends):
            return JSONResponse({"status": "ok"})
        return unavailable("no healthy backend")

    @app.get("/metrics", tags=["server"], response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    answer_head(app)
    app.add_middleware(GatewayMiddleware, api_key=None, max_body_bytes=config.max_request_bytes)
    allow_origins(app, config.allowed_origins)
    return app
