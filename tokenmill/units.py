"""Sizes and ports as people write them on a command line, parsed without importing torch (the router reads them
too)."""
from __future__ import annotations

import argparse
import math

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


def check_max_request_bytes(size: int) -> None:
    """--max-request-bytes of `serve` and `router`: under one byte every request would be a 413."""
    if size < 1:
        raise ValueError(f"--max-request-bytes must be at least 1 byte, got {size}")
