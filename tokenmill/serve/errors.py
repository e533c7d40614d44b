"""Every failure leaves the server in OpenAI's error shape {"error": {"message", "type", "param", "code"}}, with
the status a client can act on; an unexpected exception is a 500 for that one request, never a crash."""
from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_error", 503: "service_unavailable", 504: "timeout_error"}
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def sse_error(err: APIError) -> str:
    """An error inside an event stream, as OpenAI's client expects it."""
    return f"data: {json.dumps(err.body())}\n\n"


def _param(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages.0.content': union-member tags (type and model
    names) are dropped, field names are snake_case."""
    parts = [str(p) for p in loc[1:]
             if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_NAMES and not p[0].isupper())]
    return ".".join(parts) or None


def _is_tag(p: Any) -> bool:
    """A union member's tag in a pydantic error location ('str', 'list[int]', 'TextContentPart', ...)."""
    return isinstance(p, str) and (not p.isidentifier() or p in _TYPE_NAMES or p[0].isupper())


_NAMES = {"str": ("a string", "strings"), "int": ("an integer", "integers"), "float": ("a number", "numbers"),
          "bool": ("true or false", "booleans"), "TextContentPart": ('a text part {"type": "text", "text": ...}',
                                                                    'text parts {"type": "text", "text": ...}')}


def _describe(tag: str, plural: bool = False) -> str:
    """'list[function-after[_utf8(), str]]' -> 'a list of strings': a union member in words."""
    tag = re.sub(r"function-\w+\[[^,\[\]]*\(\), ", "", tag)
    while tag.count("]") > tag.count("["):  # the wrapper's closing bracket, left by the substitution
        tag = tag[::-1].replace("]", "", 1)[::-1]
    if tag.startswith("list[") and tag.endswith("]"):
        return ("lists of " if plural else "a list of ") + _describe(tag[5:-1], plural=True)
    return _NAMES.get(tag, (tag, tag))[plural]


def _union_message(param: str, errors: list[dict[str, Any]], at: int) -> str:
    """One message for a value that matched none of a union's members (each member's own error would read as if
    the first member were the only type allowed)."""
    tags = list(dict.fromkeys(e["loc"][at] for e in errors))
    whole = next((e["input"] for e in errors if len(e["loc"]) == at + 1 and "input" in e), None)
    got = f", got {json.dumps(whole)[:60]}" if whole is not None else ""
    return f"{param}: must be {' or '.join(_describe(t) for t in tags)}{got}"


def _union_at(loc: tuple[Any, ...]) -> int | None:
    """The index of a union member's tag in an error location (past 'body' and the field name), if any."""
    return next((i for i, p in enumerate(loc) if i > 1 and _is_tag(p)), None)


def validation_error_response(exc: RequestValidationError, content_type: str | None) -> JSONResponse:
    """Pydantic's errors as one readable 400: the first problem of each field, at most three; a value that fits
    no member of a union is one message listing them. content_type: the request's Content-Type header."""
    messages: dict[str | None, str] = {}
    located = [(e, loc, _union_at(loc)) for e in exc.errors() for loc in [tuple(e.get("loc", ()))]]
    unions: dict[str, list[dict[str, Any]]] = {}  # a union's value (by param) -> its members' errors
    for e, loc, at in located:
        if at is not None:
            unions.setdefault(_param(loc[:at]) or "", []).append(e)
    for e, loc, at in located:
        if e.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}",
                                  code="invalid_json")
        param = _param(loc)
        if param is None and e.get("type") == "missing":
            return error_response(400, "the request needs a JSON body", code="missing_body")
        if param is None and isinstance(exc.body, bytes):  # FastAPI parses JSON only under a JSON Content-Type
            return error_response(400, f"the request body must be JSON, sent with Content-Type: application/json; "
                                       f"got Content-Type: {content_type}", code="invalid_body")
        if param is None:
            return error_response(400, "the request body must be a JSON object", code="invalid_body")
        members = unions.get(_param(loc[:at]) or "", []) if at is not None else []
        if len({u["loc"][at] for u in members}) > 1:
            # members the value's JSON type fits, failing inside it: one of them is what the client meant
            fits = {u["loc"][at] for u in members if len(u["loc"]) > at + 1 or not u["type"].endswith("_type")}
            if len(fits) != 1:
                param = _param(loc[:at])
                messages.setdefault(param, _union_message(param, members, at))
                continue
            if loc[at] not in fits:  # a member of another type: its "should be a valid ..." would mislead
                continue
        messages.setdefault(param, f"{param}: {e['msg']}" if param else e["msg"])
    first = next(iter(messages), None)
    return error_response(400, "; ".join(list(messages.values())[:3]), param=first, code="invalid_value")


FASTAPI_UNPARSABLE_BODY = "There was an error parsing the body"  # FastAPI's detail when json.loads raises
                                                                 # anything but a JSONDecodeError


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc, request.headers.get("content-type"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == FASTAPI_UNPARSABLE_BODY:  # not text or too deep to parse
            return error_response(400, "the request body could not be read: send UTF-8 JSON, uncompressed, nested "
                                       "fewer than 1000 levels deep, with no integer of more than 4300 digits",
                                  code="invalid_json")
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}
        return error_response(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
