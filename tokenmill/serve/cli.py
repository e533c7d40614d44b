"""`tokenmill serve`: the OpenAI-compatible server's command-line options."""
from __future__ import annotations

import argparse
import json
import os
import ssl
from typing import Any

from tokenmill.engine.arg_utils import add_engine_args
from tokenmill.units import add_allowed_origins_arg, check_max_request_bytes, parse_bytes, parse_port


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API with a web UI")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=parse_port, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/ (default: $TOKENMILL_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and see (default: --model, or the default model's file name)")
    p.add_argument("--max-request-bytes", type=parse_bytes, default=16 << 20,
                   help="larger request bodies get 413 (default: 16MiB)")
    add_allowed_origins_arg(p)
    p.add_argument("--ssl-certfile", default=None, metavar="PEM",
                   help="vLLM's: serve HTTPS with this certificate (chain), with --ssl-keyfile (default: HTTP)")
    p.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="vLLM's: the certificate's private key")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds for requests in flight to finish before they are aborted "
                        "(default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="(default: %(default)s)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log every HTTP request (default: on)")
    p.add_argument("--chat-template", type=chat_template_arg, default=None, metavar="FILE_OR_TEXT",
                   help="a jinja2 chat template, its file or its text, used instead of the model's "
                        "(default: the model's)")
    p.add_argument("--default-chat-template-kwargs", type=chat_template_kwargs_arg, default={}, metavar="JSON",
                   help="vLLM's: a JSON object of chat-template variables for every chat, such as "
                        "'{\"enable_thinking\": false}'; a request's chat_template_kwargs override them "
                        "(default: none)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="take a chat_template in chat and /tokenize requests; without it they are refused, as a "
                        "template is code the server runs (default: off)")
    add_engine_args(p)
    p.set_defaults(func=run)


def chat_template_kwargs_arg(value: str) -> dict[str, Any]:
    """--default-chat-template-kwargs: a JSON object of template variables, checked as a request's would be."""
    from tokenmill.tokenizer import check_chat_template_kwargs
    try:
        kwargs = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): give an object such as '{{\"enable_thinking\": false}}'")
    try:
        return check_chat_template_kwargs(kwargs)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("chat_template_kwargs", "it", 1)) from e


def chat_template_arg(value: str) -> tuple[str, str]:
    """--chat-template as vLLM takes it: a file's path, or the template's text itself. Returns (the template, where
    it came from), checked to compile, so a bad template stops the server before the model loads."""
    from tokenmill.tokenizer import compiled_chat_template
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template, source = f.read(), f"--chat-template {value}"
    elif "{" in value:
        template, source = value, "--chat-template"
    else:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a file nor a jinja2 template; give a template's "
                                         "path or its text")
    try:
        compiled_chat_template(template, source)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return template, source


def check_tls(certfile: str | None, keyfile: str | None) -> None:
    """--ssl-certfile and --ssl-keyfile load as a pair, checked before the model loads (uvicorn would say it only
    after)."""
    if (certfile is None) != (keyfile is None):
        raise ValueError("HTTPS needs both --ssl-certfile and --ssl-keyfile; give the two or neither")
    if certfile is None:
        return
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file; give a PEM file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except ssl.SSLError as e:
        raise ValueError(f"--ssl-certfile {certfile} with --ssl-keyfile {keyfile}: not a PEM certificate and its "
                         f"private key ({e.reason or e})") from None


def run(ns: argparse.Namespace) -> None:
    check_max_request_bytes(ns.max_request_bytes)
    check_tls(ns.ssl_certfile, ns.ssl_keyfile)
    from tokenmill.serve.launcher import run_server
    run_server(ns)
