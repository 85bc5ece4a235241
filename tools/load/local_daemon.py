"""A daemon subprocess started by a load tool (bench, soak, chaos), and waiting for it.

The daemon runs in a private short directory (unix socket paths are limited
to 107 bytes) with admission limits raised so that the load tool, not the
waiting-room size, decides the load; `stop()` sends SIGTERM and reports the
exit status, and the directory goes with it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from tools.load import child_process

# What the load tools start a daemon with unless told otherwise: the load
# generator, not the waiting room, decides how much is queued.
LOAD_SETTINGS = ("admission.max_waiting_requests=100000", "admission.max_waiting_prompt_tokens=1000000000")


@dataclass
class LocalDaemon:
    proc: subprocess.Popen
    endpoint: str
    runtime_dir: str
    log_path: str
    exit_code: int | None = None
    _tmp: str = field(default="", repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 3000) -> str:
        return child_process.log_tail(self.log_path, n)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait, SIGKILL if it does not exit; returns the exit status (negative = signal)."""
        self.exit_code = child_process.stop(self.proc, timeout)
        return self.exit_code

    def process_tree(self) -> list[int]:
        """The daemon's descendants now (its chip workers)."""
        import psutil

        try:
            return [k.pid for k in psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error:
            return []

    def stop_and_check(self, worker_pids: list[int] | None = None) -> list[str]:
        """SIGTERM, then what a clean stop must leave: exit 0, no worker alive, nothing in /dev/shm.

        Returns the violations (empty when clean); workers that outlived it are killed.
        """
        import psutil

        workers = sorted({*(worker_pids or []), *self.process_tree()})
        out = []
        code = self.stop()
        if code != 0:
            out.append(f"daemon exited {code} after SIGTERM, expected 0")
        deadline = time.monotonic() + 5
        alive = workers
        while alive and time.monotonic() < deadline:
            alive = [p for p in workers if alive_pid(p)]
            if alive:
                time.sleep(0.1)
        if alive:
            out.append(f"worker processes {alive} outlived the daemon")
            for p in alive:
                try:
                    psutil.Process(p).kill()
                except psutil.Error:
                    pass
        left, size = shm_of({self.pid, *workers})
        if left:
            out.append(f"{left} shared-memory objects ({size} bytes) of the daemon left in /dev/shm")
        return out

    def cleanup(self) -> None:
        self.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _exit_on_sigterm() -> None:
    """SIGTERM to a load tool runs its `finally` blocks (daemon stopped, directory removed), like Ctrl-C."""
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def daemon_command(endpoint: str, runtime_dir: str, *, backend: str, chips: int, board: str,
                   settings: list[str] | tuple[str, ...] = (), backend_options: list[str] | tuple[str, ...] = (),
                   extra: list[str] | tuple[str, ...] = (), python: str = sys.executable) -> list[str]:
    """The command line of `python -m engine.daemon.main`; `settings` and `backend_options` are KEY=VALUE
    strings (TOML values), `extra` more `npuserve serve` flags. The test suite starts its daemons with it too."""
    cmd = [python, "-m", "engine.daemon.main", "--backend", backend, "--chips", str(chips),
           "--runtime-dir", runtime_dir, "--endpoint", endpoint, "--board", board]
    for kv in settings:
        cmd += ["--set", kv]
    for kv in backend_options:
        cmd += ["--backend-option", kv]
    return cmd + list(extra)


def start(*, backend: str, chips: int, settings: list[str] | tuple[str, ...] = (),
          backend_options: list[str] | tuple[str, ...] = (), prefix: str = "npl-",
          env: dict | None = None, wrap: list[str] | None = None, extra: list[str] | tuple[str, ...] = (),
          endpoint: str | None = None, board: str | None = None,
          limits: tuple[str, ...] = LOAD_SETTINGS, python: str = sys.executable, cwd: str | None = None) -> LocalDaemon:
    """Start `python -m engine.daemon.main` in a fresh private directory, on an ipc:// endpoint there
    unless `endpoint` names one (tcp://, for several daemons behind a balancer).

    `wrap` prefixes the command (e.g. a namespace launcher for the /dev/shm chaos scenario); `extra`
    is appended to it (more `npuserve serve` flags, e.g. `--trace FILE`); `limits` are the admission
    settings that come before `settings`; `python` and `cwd` run another source tree's daemon (with its
    PYTHONPATH in `env`).
    """
    _exit_on_sigterm()
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    endpoint = endpoint or f"ipc://{tmp}/d.sock"
    cmd = daemon_command(endpoint, tmp, backend=backend, chips=chips, board=board or f"l{os.getpid() % 100000}",
                         settings=(*limits, *settings), backend_options=backend_options, extra=extra, python=python)
    log_path = os.path.join(tmp, "daemon.log")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*(wrap or []), *cmd], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd or root, env=env)
    return LocalDaemon(proc, endpoint, tmp, log_path, _tmp=tmp)


def wait_healthy(endpoint: str, daemon: LocalDaemon | None = None, timeout: float = 120.0,
                 chips_up: int = 1, backends_up: int | None = None) -> dict:
    """Poll `health` until at least `chips_up` chips serve (and, for a balancer, `backends_up` backends
    route); raise SystemExit with the daemon's log otherwise."""
    from engine.client import Client
    from engine.errors import ClientError

    deadline = time.monotonic() + timeout
    with Client(endpoint, timeout=0.5) as c:
        while time.monotonic() < deadline:
            if daemon is not None and daemon.proc.poll() is not None:
                raise SystemExit(f"daemon exited with {daemon.proc.returncode} during start-up:\n"
                                 f"{daemon.log_tail()}")
            try:
                h = c.health()
                if h.get("chips_up", 0) >= chips_up and h.get("backends_up", 0) >= (backends_up or 0):
                    return h
                time.sleep(0.05)
            except ClientError:
                pass
    raise SystemExit(f"daemon at {endpoint} not healthy within {timeout:.0f} s"
                     + (f":\n{daemon.log_tail()}" if daemon else "; is it running? try `npuserve health`"))


def alive_pid(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def shm_of(pids: set[int]) -> tuple[int, int]:
    """(count, allocated bytes) of /dev/shm objects whose name says one of `pids` owns them."""
    from ipc.naming import parse_owner_pid

    count = size = 0
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return 0, 0
    for n in names:
        if parse_owner_pid(n) in pids:
            count += 1
            try:
                size += os.stat(os.path.join("/dev/shm", n)).st_size  # allocated, not merely touched
            except FileNotFoundError:
                pass
    return count, size


def stats(endpoint: str) -> dict:
    from engine.client import Client

    with Client(endpoint, timeout=10) as c:
        return c.stats()
