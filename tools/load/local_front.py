"""npuserve's HTTP front (`npuserve http`) as a subprocess of a benchmark, in front of a daemon it started.

`start(upstream)` runs `npuserve http --listen 127.0.0.1:PORT --upstream
ENDPOINT` on a free loopback port and waits until `GET /health` answers 200;
`stop()` sends SIGTERM. The front's output goes to a log file shown when it
fails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tools.load.child_process import Child
from tools.load.ports import free_port

if TYPE_CHECKING:
    from tools.load.local_daemon import LocalDaemon


@dataclass
class LocalFront(Child):
    url: str = ""

    def cleanup(self) -> None:
        self.stop()
        try:
            os.unlink(self.log_path)
        except FileNotFoundError:
            pass


def start(upstream: str, *, extra: list[str] | tuple[str, ...] = (), timeout: float = 60.0) -> LocalFront:
    """Start the front on `upstream` (a daemon or balancer endpoint) and wait for its /health."""
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="npf-", suffix=".log", dir="/tmp")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "tools.cli", "http", "--listen", f"127.0.0.1:{port}", "--upstream", upstream,
           *extra]
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=root)
    front = LocalFront(proc, log_path, url=f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"`{' '.join(cmd[2:])}` exited with {proc.returncode}:\n{front.log_tail()}")
        try:
            with urllib.request.urlopen(front.url + "/health", timeout=1.0) as resp:
                if resp.status == 200:
                    return front
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    tail = front.log_tail()
    front.cleanup()
    raise SystemExit(f"the HTTP front on {front.url} did not answer /health within {timeout:.0f} s:\n{tail}")


@contextlib.contextmanager
def daemon_and_front(prog: str, *, backend: str, chips: int, settings: list[str], prefix: str,
                     front_extra: list[str] | tuple[str, ...] = (), daemon_extra: list[str] | tuple[str, ...] = ()
                     ) -> Iterator[tuple["LocalDaemon", LocalFront, dict]]:
    """A daemon (`local_daemon.start`; `daemon_extra`: more `npuserve serve` flags, e.g. `--lora NAME=PATH`)
    and a front on it: (daemon, front, the daemon's model); both logs' tails on stderr when the body fails,
    both stopped after."""
    from tools.load import local_daemon

    d = local_daemon.start(backend=backend, chips=chips, settings=settings, prefix=prefix, extra=daemon_extra)
    front = None
    try:
        model = local_daemon.wait_healthy(d.endpoint, d, timeout=300)["model"]
        front = start(d.endpoint, extra=front_extra)
        yield d, front, model
    except BaseException:
        sys.stderr.write(f"{prog}: daemon log tail:\n{d.log_tail()}\n")
        if front is not None:
            sys.stderr.write(f"{prog}: front log tail:\n{front.log_tail()}\n")
        raise
    finally:
        if front is not None:
            front.cleanup()
        d.cleanup()
