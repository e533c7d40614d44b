"""The FastAPI app: the OpenAI-compatible API, tokenizer endpoints, health, version, Prometheus metrics, and the web
UI with its dashboard data. The app owns the async engine's life: the loop starts and stops with the app."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Union

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import Discriminator, Tag

from tokenmill import __version__
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.serve.dashboard import Dashboard
from tokenmill.serve.errors import APIError, error_response, install_error_handlers
from tokenmill.serve.metrics import ServerMetrics
from tokenmill.serve.middleware import GatewayMiddleware, allow_origins, answer_head
from tokenmill.serve.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                      CompletionRequest, CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                      ErrorResponse, HealthResponse, ModelCard, ModelList, TokenizeChatRequest,
                                      TokenizeCompletionRequest, TokenizeResponse, VersionResponse)
from tokenmill.serve.responses_protocol import ResponsesRequest, ResponsesResponse
from tokenmill.serve.serving import OpenAIServing

logger = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
DASHBOARD_PERIOD_S = 1.0


def _tokenize_kind(body: Any) -> str:
    """A body with messages is a chat request, any other a prompt: a bad body then gets the errors of the request it
    meant, not also those of the other ("prompt: Field required" beside a problem with its messages)."""
    return "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body else "TokenizeCompletionRequest"


# the tags are class names, which error params leave out (errors._param)
TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")],
                                  Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")]],
                            Discriminator(_tokenize_kind)]


@dataclass
class ServerConfig:
    model_name: str
    model_root: str
    api_key: str | None = None
    max_request_bytes: int = 16 << 20
    trust_request_chat_template: bool = False
    allowed_origins: list[str] = field(default_factory=list)  # CORS (middleware.allow_origins)
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # under each request's own


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse} for code in codes}


def _event_stream(chunk: type) -> dict[int | str, dict[str, Any]]:
    """The 200 response of a generation endpoint: JSON, or with stream: true, server-sent events of `chunk`."""
    return {200: {"content": {"text/event-stream": {"schema": {
        "type": "string", "description": f"`data: <{chunk.__name__} JSON>` events, then `data: [DONE]`",
        "contentSchema": {"$ref": f"#/components/schemas/{chunk.__name__}"}}}}}}


def build_app(engine: LLMEngine, config: ServerConfig, executor: ThreadPoolExecutor | None = None) -> FastAPI:
    """executor: the engine thread the engine was built on (async_engine.engine_thread)."""
    metrics = ServerMetrics(config.model_name)
    async_engine = AsyncEngine(engine, observer=metrics, executor=executor)
    serving = OpenAIServing(async_engine, config.model_name, metrics, config.trust_request_chat_template,
                            config.default_chat_template_kwargs)
    dashboard = Dashboard()
    started = int(time.time())

    async def sample_dashboard() -> None:
        while True:
            await asyncio.sleep(DASHBOARD_PERIOD_S)
            try:
                dashboard.sample(await async_engine.get_stats(), metrics.take_window())
            except Exception:
                logger.exception("dashboard sampling failed")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        sampler = asyncio.create_task(sample_dashboard())
        yield
        sampler.cancel()
        await async_engine.stop()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan, strict_content_type=False,
                  description="OpenAI-compatible LLM server. Errors use OpenAI's shape "
                              '{"error": {"message", "type", "param", "code"}}.')
    app.state.serving = serving
    app.state.engine = async_engine
    install_error_handlers(app)
    app.add_middleware(GatewayMiddleware, api_key=config.api_key, max_body_bytes=config.max_request_bytes)
    allow_origins(app, config.allowed_origins)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, tags=["openai"],
              responses={**_event_stream(ChatCompletionChunk), **_errors(400, 401, 404, 413, 429, 500, 503, 504)})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat completion over the model's chat template; `stream: true` answers with server-sent events."""
        return await serving.chat(body, request)

    @app.post("/v1/completions", response_model=CompletionResponse, tags=["openai"],
              responses={**_event_stream(CompletionResponse), **_errors(400, 401, 404, 413, 429, 500, 503, 504)})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        """Text completion of one prompt or a batch; `stream: true` answers with server-sent events."""
        return await serving.completion(body, request)

    @app.post("/v1/responses", response_model=ResponsesResponse, tags=["openai"],
              responses={200: {"content": {"text/event-stream": {"schema": {
                  "type": "string", "description": "`event: <type>` and `data: <event JSON>` pairs in OpenAI's order, "
                                                   "from response.created to response.completed (or "
                                                   "response.incomplete, or error)"}}}},
                         **_errors(400, 401, 404, 413, 429, 500, 503, 504)})
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, text only, nothing stored: the instructions and input messages are a chat;
        `stream: true` answers with OpenAI's typed server-sent events."""
        return await serving.responses(body, request)

    card = ModelCard(id=config.model_name, created=started, root=config.model_root, max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList, tags=["openai"], responses=_errors(401))
    async def list_models() -> ModelList:
        return ModelList(data=[card])

    # :path, since a served name from --model is often a path ("org/name"; OpenAI's client sends its / as %2F)
    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, tags=["openai"], responses=_errors(401, 404))
    async def retrieve_model(model_id: str) -> ModelCard:
        """The served model's entry of /v1/models."""
        serving.check_model(model_id)
        return card

    @app.post("/tokenize", response_model=TokenizeResponse, tags=["tokenizer"], responses=_errors(400, 404, 413))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a prompt, or of chat messages rendered with the chat template."""
        serving.check_model(body.model)
        if engine.tokenizer is None:
            raise APIError(400, "this server has no tokenizer (dummy weights)")
        if isinstance(body, TokenizeChatRequest):
            ids = await serving.chat_prompt_ids(body.messages, body.add_generation_prompt,
                                                  body.continue_final_message, body.chat_template_kwargs,
                                                  body.chat_template, add_special_tokens=body.add_special_tokens)
        else:
            ids = await serving.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                                token_strs=engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs
                                else None)

    @app.post("/detokenize", response_model=DetokenizeResponse, tags=["tokenizer"], responses=_errors(400, 404, 413))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids with special tokens kept, as vLLM's: /tokenize's ids of chat messages come back
        as the rendered chat template, and tokenize again to the same ids."""
        serving.check_model(body.model)
        if engine.tokenizer is None:
            raise APIError(400, "this server has no tokenizer (dummy weights)")
        vocab = engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens", "invalid_value")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False))

    @app.get("/health", response_model=HealthResponse, tags=["server"], responses=_errors(503))
    async def health() -> Response:
        """200 while the server takes requests; 503 while it drains, if the engine failed for good (its
        tensor-parallel group is gone) or if the engine loop stopped."""
        if async_engine.failure is not None:
            return error_response(503, f"the engine failed: {async_engine.failure}", code="engine_unavailable")
        if serving.draining:
            return error_response(503, "the server is shutting down", code="draining")
        if not async_engine.is_running:
            return error_response(503, "the engine loop is not running", code="engine_unavailable")
        return JSONResponse(HealthResponse().model_dump())

    @app.get("/version", response_model=VersionResponse, tags=["server"])
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics", tags=["server"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition"}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(await async_engine.get_stats()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats", tags=["server"])
    async def stats() -> dict[str, Any]:
        """The dashboard's data: engine statistics now and one point a second for the last minutes."""
        return {"model": config.model_name, **dashboard.snapshot(await async_engine.get_stats())}

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(os.path.join(STATIC_DIR, "index.html"))

    def openapi() -> dict[str, Any]:
        """FastAPI's schema plus the streaming chunk models, which no route returns as JSON."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            chunk = ChatCompletionChunk.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in chunk.pop("$defs", {}).items():
                components.setdefault(name, sub)
            components["ChatCompletionChunk"] = chunk
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    answer_head(app)
    return app
