"""forward() against an httpx mock backend: what reaches the backend and what comes back to the client."""
from __future__ import annotations

import asyncio
import gzip
import json

import httpx
from starlette.requests import Request

from tokenmill.router.backend import Backend
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.proxy import forward


def client_request(body: bytes) -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"a=1&a=2&b=x%20y",
             "headers": [(b"x-dup", b"one"), (b"x-dup", b"two"), (b"accept-encoding", b"gzip"),
                         (b"content-type", b"application/json")]}

    async def receive() -> dict:
        await asyncio.sleep(3600)  # the client stays connected
        return {"type": "http.disconnect"}
    return Request(scope, receive)


def test_request_goes_through_as_it_came_and_a_compressed_answer_arrives_decoded() -> None:
    """Repeated headers and query keys reach the backend (the raw query string), the backend is asked for an
    uncompressed answer, and one it compresses anyway reaches the client decoded, without its content-encoding."""
    seen: list[httpx.Request] = []
    answer = json.dumps({"ok": True}).encode()

    def backend(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=gzip.compress(answer),
                              headers={"content-type": "application/json", "content-encoding": "gzip"})

    async def run() -> tuple[int, bytes, dict]:
        b = Backend("http://backend", "short")
        async with httpx.AsyncClient(transport=httpx.MockTransport(backend)) as client:
            response = await forward(client, b, client_request(b"{}"), b"{}", RouterMetrics([b]))
        return response.status_code, response.body, dict(response.headers)

    status, body, headers = asyncio.run(run())
    assert status == 200 and json.loads(body) == {"ok": True} and "content-encoding" not in headers
    upstream = seen[0]
    assert upstream.url.query == b"a=1&a=2&b=x%20y"
    assert upstream.headers.get_list("x-dup") == ["one", "two"]
    assert upstream.headers["accept-encoding"] == "identity"


def test_headers_the_connection_header_names_stop_at_the_router() -> None:
    """A header named in Connection belongs to one hop (RFC 9110, 7.6.1): the router passes it on neither to the
    backend nor back to the client; the others go through."""
    seen: list[httpx.Request] = []

    def backend(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=b"{}", headers={"content-type": "application/json",
                                                           "connection": "X-Hop-Answer", "x-hop-answer": "1",
                                                           "x-kept": "2"})

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"connection", b"keep-alive, X-Hop"), (b"x-hop", b"secret"), (b"x-end", b"yes"),
                         (b"content-type", b"application/json")]}

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def run() -> dict:
        b = Backend("http://backend", "short")
        async with httpx.AsyncClient(transport=httpx.MockTransport(backend)) as client:
            response = await forward(client, b, Request(scope, receive), b"{}", RouterMetrics([b]))
        return dict(response.headers)

    headers = asyncio.run(run())
    assert "x-hop" not in seen[0].headers and seen[0].headers["x-end"] == "yes"
    assert "x-hop-answer" not in headers and headers["x-kept"] == "2"
