"""The daemons and balancers one benchmark run starts together, on tcp:// loopback, all stopped by `close()`.

For the benchmarks that put a balancer (or a prefill/decode pair) in front of
several one-chip daemons: each daemon through `local_daemon.start`, each
balancer through `local_balancer.start`, stopped in the reverse order of
their start.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Callable

from tools.load import local_balancer, local_daemon
from tools.load.ports import free_port

# A daemon behind a balancer: the load generator, not its waiting room, decides how much is queued.
FLEET_LIMITS = ("admission.max_waiting_requests=100000",)


class Fleet:
    def __init__(self, prefix: str) -> None:
        self.dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")  # balancer logs, and what the caller puts here
        self._stops: list[Callable[[], object]] = []

    def daemon(self, backend: str, board: str, settings: list[str], backend_options: list[str] | tuple = ()) -> str:
        """A one-chip daemon on a free tcp:// port; its endpoint."""
        d = local_daemon.start(backend=backend, chips=1, settings=settings, backend_options=backend_options,
                               prefix=f"{board}-", endpoint=f"tcp://127.0.0.1:{free_port()}", board=board,
                               limits=FLEET_LIMITS)
        self._stops.append(d.cleanup)
        return d.endpoint

    def balancer(self, flags: list[str], name: str) -> local_balancer.LocalBalancer:
        b = local_balancer.start(flags, self.dir, name)
        self._stops.append(b.stop)
        return b

    def close(self) -> None:
        for stop in reversed(self._stops):
            stop()
        shutil.rmtree(self.dir, ignore_errors=True)
