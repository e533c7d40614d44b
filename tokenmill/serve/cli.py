"""`tokenmill serve`: the OpenAI-compatible server's command-line options."""
from __future__ import annotations

import argparse
import os

from tokenmill.engine.arg_utils import add_engine_args
from tokenmill.units import parse_bytes


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API with a web UI")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/ (default: $TOKENMILL_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and see (default: --model, or the default model's file name)")
    p.add_argument("--max-request-bytes", type=parse_bytes, default=16 << 20,
                   help="larger request bodies get 413 (default: 16MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds for requests in flight to finish before they are aborted "
                        "(default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="(default: %(default)s)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log every HTTP request (default: on)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> None:
    from tokenmill.serve.launcher import run_server
    run_server(ns)
