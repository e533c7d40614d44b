"""Sizes, ports and origins as people write them on a command line, parsed without importing torch (the router
reads them too)."""
from __future__ import annotations

import argparse
import json
import math
import re

_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "b": 1}


class SizeError(ValueError, argparse.ArgumentTypeError):
    """A ValueError to callers; as the type of a flag, argparse shows its message (for a plain ValueError it would
    say only "invalid parse_bytes value")."""


def parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '512MiB', '2GB'."""
    t = text.strip().lower()
    unit = next((u for u in _UNITS if t.endswith(u)), "")
    try:
        size = float(t[: len(t) - len(unit)]) * _UNITS.get(unit, 1)
    except ValueError:
        size = math.nan
    if not math.isfinite(size):  # int() would raise an OverflowError for inf, a message naming no unit for nan
        raise SizeError(f"invalid size {text!r}: expected a number of bytes, optionally with a unit (case ignored): "
                        "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024); e.g. 80GiB, "
                        "512MiB, 2GB")
    return int(size)


def parse_port(text: str) -> int:
    """A TCP port to listen on: one out of range was a traceback from bind(), for `serve` after the model loaded."""
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {text!r}")
    return int(text)


def parse_origins(text: str) -> list[str]:
    """An --allowed-origins value: '*', an origin (scheme://host[:port]), or vLLM's form, a JSON list of them. A
    value that is no origin (a path, no scheme) would never match a browser's Origin header, silently."""
    try:
        origins = json.loads(text) if text.lstrip().startswith("[") else [text]
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of origins: {e}") from e
    for origin in origins:
        if not isinstance(origin, str) or not (origin == "*" or re.fullmatch(r"https?://[^/\s]+", origin)):
            raise argparse.ArgumentTypeError(f"{origin!r} is not an origin; give '*' or scheme://host[:port], "
                                             "e.g. https://app.example.com")
    return origins


def add_allowed_origins_arg(p: argparse.ArgumentParser) -> None:
    """--allowed-origins of `serve` and `router`: a list of lists (one a value) that allowed_origins flattens."""
    p.add_argument("--allowed-origins", type=parse_origins, nargs="+", default=[], metavar="ORIGIN",
                   help="origins whose web pages may call the API from a browser (CORS): '*', or origins such as "
                        "https://app.example.com, or vLLM's JSON list (default: none, same-origin pages only)")


def allowed_origins(ns: argparse.Namespace) -> list[str]:
    """Every --allowed-origins value's origins, in one list."""
    return [origin for value in ns.allowed_origins for origin in value]


def check_max_request_bytes(size: int) -> None:
    """--max-request-bytes of `serve` and `router`: under one byte every request would be a 413."""
    if size < 1:
        raise ValueError(f"--max-request-bytes must be at least 1 byte, got {size}")
