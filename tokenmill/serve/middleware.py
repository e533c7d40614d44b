"""The gateway in front of the routes, as plain ASGI (so streaming and disconnects pass through untouched):
the bearer-token check on /v1/ and the request-size limit; CORS for the origins allowed (allow_origins); and HEAD on
every GET route (answer_head), for the server and the router alike."""
from __future__ import annotations

import hmac
import json

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.serve.errors import error_body


async def _send_error(send: Send, status: int, message: str, code: str,
                      headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key and scope["path"].startswith("/v1/") and not self._authorized(scope):
            await _send_error(send, 401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                              "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(send)
            return
        body: list[Message] = []
        size = 0
        more = scope["method"] in ("POST", "PUT", "PATCH")
        while more:
            message = await receive()
            if message["type"] != "http.request":
                body.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                await self._too_large(send)
                return
            body.append(message)
            more = message.get("more_body", False)

        async def replay() -> Message:
            return body.pop(0) if body else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        await _send_error(send, 413, f"the request body exceeds the limit of {self.max_body_bytes} bytes "
                                     "(--max-request-bytes)", "request_too_large")


def answer_head(app: FastAPI) -> None:
    """HEAD on each GET route, as Starlette gives its own routes and FastAPI does not (it answers 405): load
    balancers and uptime checks probe with HEAD. The same endpoint runs, so the status is GET's; uvicorn sends the
    headers without the body. The twins stay out of the schema, where they would repeat each GET operation."""
    for route in list(app.routes):
        if isinstance(route, APIRoute) and "GET" in route.methods:
            app.add_api_route(route.path, route.endpoint, methods=["HEAD"], response_class=route.response_class,
                              include_in_schema=False)


def allow_origins(app: FastAPI, origins: list[str]) -> None:
    """Let pages of these origins call the API from a browser (CORS; vLLM's --allowed-origins). Added last, so it
    is outermost: a browser's preflight carries no API key and is answered before the key is checked. Without
    origins nothing is added and only same-origin pages (the web UI) can call."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
