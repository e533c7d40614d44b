"""Forwarding one request to one backend: the body and headers go as they came, the answer comes back as the
backend wrote it (server-sent events relayed whole, event by event), and a backend that fails under a request
becomes a retryable OpenAI-shaped error: 503 `backend_unavailable` with Retry-After, or that error as the last
event of a stream that had begun."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.router.backend import Backend
from tokenmill.router.metrics import RouterMetrics
from tokenmill.serve.errors import error_body, error_response

T = TypeVar("T")

BACKEND_HEADER = "x-tokenmill-backend"
RETRY_AFTER_S = 1
# per-connection headers are never forwarded; accept-encoding becomes "identity", so that event streams come
# uncompressed (httpx would ask for gzip otherwise)
_REQUEST_DROP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                           "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding"})
_RESPONSE_DROP = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"})


def _passed_on(headers: list[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    """Headers a proxy forwards: none of the per-connection ones, nor any that the Connection header names as
    such (RFC 9110, 7.6.1: they describe the hop they came over)."""
    named = {token.strip().lower() for k, v in headers if k == "connection" for token in v.split(",")}
    return [(k, v) for k, v in headers if k not in drop and k not in named]


class Unreachable(Exception):
    """The backend refused the connection: nothing was sent, so another backend may take the request."""


class _BackendDown(Exception):
    """The health check declared the backend dead while the request was in flight."""


class _ClientGone(Exception):
    pass


def unavailable(message: str, backend: Backend | None = None) -> Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    if backend is not None:
        headers[BACKEND_HEADER] = backend.url
    return error_response(503, message, code="backend_unavailable", headers=headers)


def _lost_event(message: str) -> bytes:
    """The error as a stream's last event, then [DONE], as the backend itself ends a failed stream."""
    return f"data: {json.dumps(error_body(503, message, code='backend_unavailable'))}\n\ndata: [DONE]\n\n".encode()


def _lost_message(backend: Backend, e: Exception) -> str:
    why = "it was declared down" if isinstance(e, _BackendDown) else f"{type(e).__name__}: {e}"
    return f"backend {backend.url} failed during the request ({why}); retry it"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Watch:
    """What ends a request early: its backend declared dead by the health check, or, until the answer starts, its
    client disconnecting (a streaming answer then notices that itself)."""

    def __init__(self, dead: asyncio.Event, request: Request) -> None:
        self.dead = asyncio.ensure_future(dead.wait())
        self.gone: asyncio.Future[None] | None = asyncio.ensure_future(_wait_disconnect(request))

    def forget_client(self) -> None:
        if self.gone is not None:
            self.gone.cancel()
            self.gone = None

    async def until(self, aw: Awaitable[T]) -> T:
        task = asyncio.ensure_future(aw)
        stops = {self.dead} if self.gone is None else {self.dead, self.gone}
        try:
            await asyncio.wait({task, *stops}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if task.done():
            return task.result()
        raise _BackendDown() if self.dead.done() else _ClientGone()

    def close(self) -> None:
        self.dead.cancel()
        self.forget_client()


class _Exchange:
    """One request in flight on one backend, counted in its in-flight requests until closed."""

    def __init__(self, backend: Backend, request: Request, metrics: RouterMetrics) -> None:
        self.backend = backend
        self.metrics = metrics
        self.watch = _Watch(backend.dead, request)
        self.upstream: httpx.Response | None = None
        backend.in_flight += 1

    def lost(self, e: Exception) -> str:
        """Book a failure under the request; the backend takes no new requests until a poll finds it healthy."""
        self.backend.set_unavailable()
        self.metrics.failed(self.backend, "down" if isinstance(e, _BackendDown) else "lost")
        return _lost_message(self.backend, e)

    async def close(self) -> None:
        self.watch.close()
        if self.upstream is not None:
            await self.upstream.aclose()
        self.backend.in_flight -= 1


def _complete_events(pending: bytes) -> int:
    """Length of the complete events at the head of `pending`: up to its last blank line."""
    return max((i + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (i := pending.rfind(sep)) >= 0), default=0)


async def _relay(exchange: _Exchange) -> AsyncIterator[bytes]:
    """The backend's events, each forwarded once whole, so that a failure can end the stream with a well-formed
    error event."""
    assert exchange.upstream is not None
    chunks = exchange.upstream.aiter_raw()
    pending = b""
    try:
        while (chunk := await exchange.watch.until(anext(chunks, None))) is not None:
            exchange.backend.progressed()
            pending += chunk
            end = _complete_events(pending)
            if end:
                yield pending[:end]
                pending = pending[end:]
    except (_BackendDown, httpx.TransportError) as e:
        yield _lost_event(exchange.lost(e))
        return
    if pending:
        yield pending


class _RelayStream(StreamingResponse):
    """The stream owns the exchange: it is closed however the stream ends, even if it never started."""

    def __init__(self, exchange: _Exchange, headers: dict[str, str]) -> None:
        assert exchange.upstream is not None
        super().__init__(_relay(exchange), status_code=exchange.upstream.status_code, headers=headers)
        self.exchange = exchange

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.exchange.close()


async def forward(client: httpx.AsyncClient, backend: Backend, request: Request, body: bytes,
                  metrics: RouterMetrics) -> Response:
    """The backend's answer to the request; raises Unreachable if it could not be connected to."""
    exchange = _Exchange(backend, request, metrics)
    owned = True
    try:
        # repeated headers and query keys go through as they came (a dict would keep the last one)
        headers = _passed_on(request.headers.items(), _REQUEST_DROP)
        headers.append(("accept-encoding", "identity"))
        query = f"?{request.url.query}" if request.url.query else ""
        upstream_request = client.build_request(request.method, backend.url + request.url.path + query, content=body,
                                                headers=headers)
        try:
            exchange.upstream = await exchange.watch.until(client.send(upstream_request, stream=True))
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            backend.set_unavailable()
            metrics.failed(backend, "connect")
            raise Unreachable(f"{type(e).__name__}: {e}") from e
        answer = dict(_passed_on(exchange.upstream.headers.items(), _RESPONSE_DROP))
        answer[BACKEND_HEADER] = backend.url
        if exchange.upstream.headers.get("content-type", "").startswith("text/event-stream"):
            exchange.watch.forget_client()
            owned = False
            return _RelayStream(exchange, answer)
        content = await exchange.watch.until(exchange.upstream.aread())
        answer.pop("content-encoding", None)  # aread() decoded it (a backend that compresses all the same)
        return Response(content, status_code=exchange.upstream.status_code, headers=answer)
    except (_BackendDown, httpx.TransportError) as e:
        return unavailable(exchange.lost(e), backend)
    except _ClientGone:
        return error_response(499, "the client disconnected", code="client_disconnected")
    finally:
        if owned:
            await exchange.close()
