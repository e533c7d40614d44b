"""Sizes as people write them on a command line, parsed without importing torch (the router reads them too)."""
from __future__ import annotations


def parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '512MiB', '2GB'."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "b": 1}
    t = text.strip().lower()
    for u, mult in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * mult)
    return int(float(t))
