"""Ports for test processes that must know a port before any of them binds it."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int) -> int:
    """A port p with p .. p + count - 1 free on 127.0.0.1 right now, for processes that
    must all know a port before one of them binds it (a caller retries if it was taken)."""
    for _ in range(100):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                for i in range(1, count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port + i))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no {count} adjacent free ports")
