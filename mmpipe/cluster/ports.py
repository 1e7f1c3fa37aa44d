"""Rendezvous ports for local launches.

free_port() has the kernel pick a port nothing is bound to, then leaves it in TIME_WAIT: a
connection to it is accepted and closed from the accepting side first, so for the next ~60 s the
kernel hands the port to no other bind(port 0) and to no outgoing connection as its source port,
while rank 0's TCPStore, which binds with SO_REUSEADDR, still gets it. A port that is only probed
and released (as before) sits free in the ephemeral range for the seconds the launcher and the
ranks' imports take, and a concurrent launch's own free_port(), or any connection's source port,
may take it meanwhile; a second launch whose ranks reach the first one's store lose a rank to
"TCPStore ... Connection reset by peer" (one scripts/bench_packing.py run did, with other runs on
the machine; the cause was not captured, this is the race that fits).
"""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port nothing is bound to, reserved for the launch that asks (module docstring)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the accepting side closes first: its end, local port `port`, goes to TIME_WAIT
            client.recv(1)  # wait for that FIN, so the client's close completes the handshake
    return port
