"""Rendezvous ports for local launches."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it); the launcher binds it moments later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
