"""A free loopback TCP port, for the daemons, balancers, fronts and metrics servers a tool starts for itself.

Free at the instant it is asked: another process may still take it before the
caller's child binds it (the usual race, which these short-lived tools accept).
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
