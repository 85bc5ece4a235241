"""A balancer (`npuserve balance`) a benchmark starts in front of daemons it started, on a free tcp:// port.

Its output goes to a log file in the caller's directory; `stop()` sends
SIGTERM (then SIGKILL). Wait for it with `local_daemon.wait_healthy(...,
backends_up=N)`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from tools.load.child_process import Child
from tools.load.ports import free_port


@dataclass
class LocalBalancer(Child):
    endpoint: str = ""


def start(flags: list[str], log_dir: str, name: str) -> LocalBalancer:
    """`npuserve balance --endpoint tcp://127.0.0.1:PORT FLAGS` (e.g. `--backends A,B --policy prefix`, or
    `--prefill A --decode B`), logging to `log_dir/name.log`."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log_path = os.path.join(log_dir, name + ".log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "engine.balancer.main", "--endpoint", endpoint, *flags],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return LocalBalancer(proc, log_path, endpoint=endpoint)
