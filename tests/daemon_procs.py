"""Real daemon subprocesses for the tests: started, waited for, stopped and checked, by one launcher.

The command line is the load tools' (`tools.load.local_daemon.daemon_command`);
here each daemon gets an ipc:// endpoint in a short private directory (unix
socket paths are limited to 107 bytes). A `DaemonSet` owns the daemons it
started: `close()` sends each SIGTERM and reports what a clean stop must not
leave: an unexpected exit status, a shared-memory object named for the
daemon's pid, a worker process still alive. The per-test `daemon` fixture, the
module-scoped `daemon_process` and the conformance set-ups all use it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import psutil

from repo_root import ROOT
from tools.load import local_daemon
from waiting import read_log

START_TIMEOUT_S = 90.0

_RUN_DAEMON_MAIN = """
import sys as _sys
from engine.daemon.main import main as _main
_sys.exit(_main(_sys.argv[1:]))
"""


def shm_objects_of(pid: int) -> list[str]:
    """Entries in /dev/shm (segments and semaphores) whose name says `pid` owns them."""
    from ipc.naming import parse_owner_pid

    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    return sorted(n for n in names if "npuserve" in n and parse_owner_pid(n) == pid)


def toml_value(v) -> str:
    """A Python value as the TOML literal `--set KEY=VALUE` takes."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return str(v)


@dataclass
class DaemonProc:
    proc: subprocess.Popen
    endpoint: str
    runtime_dir: str
    log_path: str
    expect_exit: int | None = 0  # None: the test checks the exit itself
    _children: list[psutil.Process] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, **kw):
        from engine.client import Client

        return Client(self.endpoint, **kw)

    def log(self) -> str:
        return read_log(self.log_path)

    def log_tail(self, n: int = 4000) -> str:
        return self.log()[-n:]

    def health(self, timeout: float = 5.0) -> dict:
        with self.client(timeout=timeout) as c:
            return c.health()

    def worker_pids(self) -> list[int]:
        return [c["pid"] for c in self.health()["chips"] if c.get("pid")]

    def remember_children(self) -> None:
        try:
            self._children = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until a chip serves (an AssertionError with the log if the daemon exits or the guard passes); then
        remember its workers, which the stop check wants gone."""
        try:
            local_daemon.wait_healthy(self.endpoint, self, timeout)
        except SystemExit as exc:
            raise AssertionError(str(exc)) from None
        self.remember_children()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        self.remember_children()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon did not exit within {timeout} s after {sig}\n{self.log()[-4000:]}")

    def stop_and_check(self) -> list[str]:
        """Stop it (unless it exited) and return what its exit left wrong; workers still alive are killed."""
        problems = []
        rc = self.stop() if self.proc.poll() is None else self.proc.returncode
        if self.expect_exit is not None and rc != self.expect_exit:
            problems.append(f"daemon {self.pid} exited {rc}, expected {self.expect_exit}:\n{self.log()[-3000:]}")
        left = shm_objects_of(self.pid)
        if left:
            problems.append(f"daemon {self.pid} left shared memory: {left}")
        alive = [c.pid for c in self._children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        if alive:
            for c in self._children:
                try:
                    c.kill()
                except psutil.NoSuchProcess:
                    pass
            problems.append(f"daemon {self.pid} left child processes {alive}")
        return problems


class DaemonSet:
    """The daemons started into one private directory; `close()` stops them and returns what their exits left
    wrong (as a context manager, leaving it asserts there was nothing)."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.daemons: list[DaemonProc] = []

    def start(self, *, backend: str = "stub", chips: int = 1, config: str | None = None,
              settings: dict | None = None, backend_options: dict | None = None, extra: list[str] | None = None,
              wait: bool = True, prelude: str | None = None, env: dict | None = None,
              board: str | None = None) -> DaemonProc:
        """`prelude`: Python source the daemon process runs before its main(), to inject a fault where no real
        one can be provoked from outside (a core bug)."""
        n = len(self.daemons)
        rt = os.path.join(self.dir, f"r{n}")
        os.makedirs(rt, mode=0o700)
        endpoint = f"ipc://{rt}/d.sock"
        log_path = os.path.join(self.dir, f"daemon{n}.log")
        cmd = local_daemon.daemon_command(
            endpoint, rt, backend=backend, chips=chips, board=board or f"t{os.getpid() % 100000}",
            settings=[f"{k}={toml_value(v)}" for k, v in (settings or {}).items()],
            backend_options=[f"{k}={toml_value(v)}" for k, v in (backend_options or {}).items()],
            extra=(["--config", config] if config else []) + list(extra or []))
        if prelude is not None:
            assert cmd[1:3] == ["-m", "engine.daemon.main"]
            cmd = [sys.executable, "-c", prelude + _RUN_DAEMON_MAIN] + cmd[3:]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=None if env is None else {**os.environ, **env})
        d = DaemonProc(proc, endpoint, rt, log_path)
        self.daemons.append(d)
        if wait:
            d.wait_healthy()
        return d

    def close(self) -> list[str]:
        return [p for d in self.daemons for p in d.stop_and_check()]

    def __enter__(self) -> "DaemonSet":
        return self

    def __exit__(self, *exc) -> None:
        problems = self.close()
        assert not problems, "\n".join(problems)


@contextlib.contextmanager
def daemon_process(backend: str = "stub", chips: int = 1, *, settings: dict | None = None,
                   backend_options: dict | None = None, extra: list[str] | None = None):
    """A daemon for a whole test module (the `daemon` fixture is per test): yields a DaemonProc, then stops it
    and checks it exited 0 and left no shared memory and no worker."""
    d = tempfile.mkdtemp(prefix="npm-", dir="/tmp")
    try:
        with DaemonSet(d) as ds:
            yield ds.start(backend=backend, chips=chips, settings=settings, backend_options=backend_options,
                           extra=extra)
    finally:
        shutil.rmtree(d, ignore_errors=True)
