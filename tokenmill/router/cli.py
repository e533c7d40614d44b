"""`tokenmill router`: the router's command-line options."""
from __future__ import annotations

import argparse
import logging
import math
import urllib.parse
from collections.abc import Callable

from tokenmill.units import add_allowed_origins_arg, allowed_origins, check_max_request_bytes, parse_bytes, parse_port


def _url(value: str) -> str:
    """A backend's base URL, scheme://host:port: http:// when no scheme is given, refused (with what is taken)
    when it has a path, a query, another scheme or a port out of range, which the router found only as a
    backend that never answered, or a traceback on its first poll."""
    parts = urllib.parse.urlsplit(value.strip() if "://" in value else "http://" + value.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.path.strip("/")
            or parts.query or parts.fragment or parts.username):
        raise argparse.ArgumentTypeError(f"{value!r} is not a server's base URL; give http(s)://HOST[:PORT], e.g. "
                                         "http://10.0.0.2:8000 (no path: the router adds /v1/...)")
    return f"{parts.scheme}://{parts.netloc.lower()}"


def _at_least(floor: float, strictly: bool = False, kind: type = float) -> Callable[[str], float]:
    """An argparse type: a finite number of `kind` >= floor (> floor if strictly)."""
    def parse(value: str) -> float:
        try:
            number = kind(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < floor or (strictly and number == floor):
            raise argparse.ArgumentTypeError(f"must be {'a number' if kind is float else 'an integer'} "
                                             f"{'>' if strictly else '>='} {floor:g}, got {value!r}")
        return number
    return parse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("router", help="spread OpenAI-compatible requests over several tokenmill servers")
    p.add_argument("--backend", type=_url, action="append", required=True, metavar="URL",
                   help="a tokenmill server of the (short) pool, e.g. http://10.0.0.2:8000 (repeatable)")
    p.add_argument("--long-backend", type=_url, action="append", default=[], metavar="URL",
                   help="a server of the long pool, for prompts over --long-prompt-threshold (repeatable)")
    p.add_argument("--long-prompt-threshold", type=_at_least(0, kind=int), default=1024, metavar="N",
                   help="prompts estimated over N tokens (characters / 4) go to the long pool (default: %(default)s)")
    p.add_argument("--affinity-slack", type=_at_least(0), default=4.0, metavar="LOAD",
                   help="a conversation stays on its backend unless that one's load exceeds the least load by more "
                        "than this (in requests; default: %(default)s)")
    p.add_argument("--poll-interval", type=_at_least(0, strictly=True), default=0.5, metavar="S",
                   help="seconds between two polls of each backend's /health and /metrics (default: %(default)s)")
    p.add_argument("--health-timeout", type=_at_least(0, strictly=True), default=2.0, metavar="S",
                   help="timeout of a health check and of connecting to a backend (default: %(default)s)")
    p.add_argument("--max-request-bytes", type=parse_bytes, default=16 << 20,
                   help="larger request bodies get 413 from the router itself, which reads a body whole before "
                        "routing it (default: 16MiB, as a server's)")
    p.add_argument("--backend-api-key", metavar="KEY",
                   help="the backends' --api-key, sent with the router's own /v1/models requests so that it knows "
                        "which models each serves (clients' requests carry their own key)")
    add_allowed_origins_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=parse_port, default=8080, help="port to listen on (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=_at_least(0), default=30.0, metavar="S",
                   help="on SIGTERM, seconds for the requests in flight to finish before they are cut "
                        "(default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="(default: %(default)s)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log every HTTP request (default: on)")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> None:
    import uvicorn

    from tokenmill.router.app import RouterConfig, build_app

    given = ns.backend + ns.long_backend
    if twice := sorted({url for url in given if given.count(url) > 1}):
        raise ValueError(f"each backend may be given once, in one pool; given more than once: {', '.join(twice)}")
    check_max_request_bytes(ns.max_request_bytes)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll and per proxied request otherwise
    app = build_app(RouterConfig(backends=ns.backend, long_backends=ns.long_backend,
                                 long_prompt_threshold=ns.long_prompt_threshold, affinity_slack=ns.affinity_slack,
                                 poll_interval=ns.poll_interval, health_timeout=ns.health_timeout,
                                 max_request_bytes=ns.max_request_bytes, backend_api_key=ns.backend_api_key,
                                 allowed_origins=allowed_origins(ns)))
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level, access_log=ns.access_log,
                timeout_graceful_shutdown=ns.shutdown_timeout)
