"""Real `npuserve http` processes (the OpenAI-compatible front) for the tests: started, waited for, stopped."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from daemon_procs import START_TIMEOUT_S
from repo_root import ROOT
from tools.load.ports import free_port
from waiting import read_log


@dataclass
class HttpFrontProc:
    """A real `npuserve http` process; `url` is its base URL (http://127.0.0.1:PORT)."""

    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        return read_log(self.log_path)

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        """(status, body) of a GET; errors statuses are returned, not raised."""
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"http front did not exit within {timeout} s:\n{self.log()[-3000:]}")


def start_http_front(upstream: str, log_path: str, args: list[str] | None = None, *, wait_up: bool = True,
                     timeout: float = START_TIMEOUT_S) -> HttpFrontProc:
    """Start `npuserve http` on a free port in front of `upstream`; wait until it listens (and, with
    `wait_up`, until its /health says the upstream answers)."""
    import urllib.error

    port = free_port()
    cmd = [sys.executable, "-m", "engine.http.main", "--listen", f"127.0.0.1:{port}", "--upstream", upstream,
           *(args or [])]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    front = HttpFrontProc(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"http front exited with {proc.returncode}:\n{front.log()[-3000:]}")
        try:
            status, _ = front.get("/health", timeout=5)
            if status == 200 or not wait_up:
                return front
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            front.stop()
            raise AssertionError(f"http front not ready within {timeout} s:\n{front.log()[-3000:]}")
        time.sleep(0.05)


@contextlib.contextmanager
def http_front_process(upstream: str, args: list[str] | None = None):
    """A front for a whole test module: yields the HttpFrontProc, then stops it and checks it exited 0."""
    log_dir = tempfile.mkdtemp(prefix="nph-", dir="/tmp")
    front = start_http_front(upstream, os.path.join(log_dir, "http.log"), args)
    try:
        yield front
    finally:
        rc = front.stop()
        text = front.log()
        shutil.rmtree(log_dir, ignore_errors=True)
    assert rc == 0, f"http front exited {rc}:\n{text[-3000:]}"
