"""A real server for the tests: `python -m tokenmill.cli serve` in a subprocess on a free port of 127.0.0.1."""
from __future__ import annotations

import ssl

from processes import Proc, wait_until

__all__ = ["Server", "wait_until"]


class Server(Proc):
    """`tokenmill serve`, ready when constructed."""

    def __init__(self, *args: str, tls: ssl.SSLContext | None = None) -> None:
        super().__init__("serve", *args, tls=tls)
        self.wait_ready()
