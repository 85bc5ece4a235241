"""The scheduler-process side of one chip: its rings, control socket and worker process.

A ChipLink owns everything that must outlive a worker crash and be cleaned up
after it: the job ring (scheduler -> worker), the result ring (worker ->
scheduler), the result doorbell (an eventfd), the PAIR socket bound on ipc://
and the child process. The daemon registers both `socket` (control messages,
heartbeats, READY/FAILED) and `result_fd` (woken after each result record) in
its poller and calls `handle_events()` when either is readable (and on its
periodic tick, so a worker that dies before READY is reported). Nothing here
blocks except `stop()`.

The result doorbell replaced a ZeroMQ RESULT message per job (a send, a hop
through ZeroMQ's I/O threads and a recv): on a 2-core host it cut the median
round trip of a job after a 1.4 ms gap from 330 to 275 us. An eventfd rather
than a pipe: one read empties it, and a dead writer leaves it quiet instead of
readable at EOF (a pipe would spin the daemon's poller after a crash).

The worker is a fresh interpreter (`python -m workers`), never a fork of a
process that holds ZeroMQ contexts or threads; it starts with
`workers.control.worker_environ()` (one BLAS thread unless told otherwise).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import zmq

from ipc.records import Job, JobResult
from ipc.doorbell import SemaphoreDoorbell
from ipc.ring import DEFAULT_LAYOUT_CACHE_ENTRIES, Ring
from workers.backends.base import BackendInfo
from workers.control import ChaosAction, ControlError, Msg, WorkerConfig, decode, encode, worker_environ

SHM_PREFIX = "npuserve"
_MAX_IPC_PATH = 100  # sockaddr_un.sun_path is 108 bytes on Linux, minus "ipc://" slack


@dataclass(frozen=True)
class Ready:
    info: BackendInfo
    pid: int


@dataclass(frozen=True)
class Result:
    result: JobResult


@dataclass(frozen=True)
class Heartbeat:
    at: float  # the worker's time.monotonic() (CLOCK_MONOTONIC is system-wide)
    jobs_done: int
    busy_job: int = -1  # under chaos "slow": the job it has just started (tests observe "mid-job" by it)


@dataclass(frozen=True)
class WorkerFailed:
    message: str  # start-up failure (bad backend, bad package, missing library, died before READY)


LinkEvent = Ready | Result | Heartbeat | WorkerFailed

_POLLIN = int(zmq.POLLIN)  # a plain int: `&` with the IntFlag member runs enum Python code on every call
_CTL_SPEC = ((1,), "<i8")  # a job record's "ctl": control messages sent before it (see workers.control)
_SHUTDOWN = encode(Msg.SHUTDOWN)
# The worker's RESULT message is a doorbell only (results are read from the ring), so the link
# recognises it by its encoded prefix instead of decoding one message per job.
_RESULT_PREFIX = encode(Msg.RESULT, job_id=0).split(b'"job_id"')[0]


class ChipLink:
    """One chip's worker, seen from the scheduler process. Single-threaded use only."""

    def __init__(
        self,
        *,
        ctx: zmq.Context,
        board: str,
        chip: int,
        backend: str,
        backend_options: dict | None = None,
        package_path: str | None = None,
        runtime_dir: str,
        ring_bytes: int = 64 << 20,
        heartbeat_interval_s: float = 0.2,
        generation: int = 0,
        package_sha256: str | None = None,
        job_spin_s: float = WorkerConfig.job_spin_s,
        ring_layout_cache_entries: int = DEFAULT_LAYOUT_CACHE_ENTRIES,
    ) -> None:
        self.ctx = ctx
        self.board = str(board)
        self.chip = int(chip)
        self.backend = backend
        self.backend_options = dict(backend_options or {})
        self.package_path = package_path
        self.runtime_dir = runtime_dir
        self.ring_bytes = int(ring_bytes)
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.job_spin_s = float(job_spin_s)  # how long the worker polls for its next job before it parks
        self.ring_layout_cache_entries = int(ring_layout_cache_entries)  # record shapes each ring end keeps
        self.generation = int(generation)  # model generation (several may run on one board at once)
        self.package_sha256 = package_sha256  # set: the package was verified for this load (the worker trusts it)
        self.socket: zmq.Socket | None = None
        self.result_fd: int | None = None  # readable when result records may be waiting; poll it beside `socket`
        self.info: BackendInfo | None = None
        self.pid: int | None = None
        self.last_heartbeat: float = 0.0
        self._proc: subprocess.Popen | None = None
        self._job_ring: Ring | None = None
        self._result_ring: Ring | None = None
        self._ipc_path: str | None = None
        self._bell: SemaphoreDoorbell | None = None
        self._ctl_sent = 0
        self._starts = 0
        self._failure_reported = False
        self._control_lost = False  # a control message the worker could not take: it is failed
        self.lora_stats: dict = {}  # the worker's last adapter report (its heartbeat's `lora`)

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        """Create rings and socket, spawn the worker; READY arrives later as an event."""
        assert self._proc is None, "ChipLink.start() on a running link"
        self._starts += 1
        gen = f"g{self.generation}-" if self.generation else ""
        path = os.path.join(self.runtime_dir, f"w{self.board}-{self.chip}-{os.getpid()}-{gen}{self._starts}.sock")
        if len(path) > _MAX_IPC_PATH:
            raise ValueError(f"runtime_dir too long for an ipc:// socket path ({len(path)} > {_MAX_IPC_PATH}): {path}")
        try:
            os.makedirs(self.runtime_dir, mode=0o700, exist_ok=True)
            layouts = self.ring_layout_cache_entries
            self._job_ring = Ring.create(SHM_PREFIX, self.board, self.ring_bytes, tag=f"c{self.chip}j",
                                         layout_cache_entries=layouts)
            self._result_ring = Ring.create(SHM_PREFIX, self.board, self.ring_bytes, tag=f"c{self.chip}r",
                                            layout_cache_entries=layouts)
            self._bell = SemaphoreDoorbell.create(SHM_PREFIX, self.board, tag=f"c{self.chip}b")
            self._ctl_sent = 0
            self.result_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            sock = self.ctx.socket(zmq.PAIR)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            self.socket = sock
            sock.bind(f"ipc://{path}")
            self._ipc_path = path
            os.chmod(path, 0o600)
            config = WorkerConfig(
                board=self.board, chip=self.chip, backend=self.backend, job_ring=self._job_ring.name,
                result_ring=self._result_ring.name, control_endpoint=f"ipc://{path}", parent_pid=os.getpid(),
                backend_options=self.backend_options, package_path=self.package_path,
                package_sha256=self.package_sha256,
                heartbeat_interval_s=self.heartbeat_interval_s, job_bell=self._bell.name,
                result_bell_fd=self.result_fd, job_spin_s=self.job_spin_s, ring_layout_cache_entries=layouts,
            )
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "workers", config.to_json()],
                stdin=subprocess.DEVNULL, close_fds=True, pass_fds=(self.result_fd,), env=worker_environ(),
            )
        except BaseException:
            self._cleanup()
            raise
        self.pid = self._proc.pid
        self.info = None
        self._failure_reported = False
        self._control_lost = False
        self.last_heartbeat = time.monotonic()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the worker to exit, escalate to SIGTERM/SIGKILL, then free everything. Idempotent."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            asked = False
            if self.socket is not None:
                try:
                    asked = self._send_control(_SHUTDOWN)  # False: no peer (not started yet, or dead)
                except zmq.ZMQError:
                    pass  # the socket cannot send at all: nobody would read it
            steps = ((None, timeout),) if asked else ()
            for sig, wait_s in steps + ((signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
                if sig is not None:
                    try:
                        proc.send_signal(sig)
                    except ProcessLookupError:
                        pass
                try:
                    proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        elif proc is not None:
            proc.wait()
        self._cleanup()

    def request_stop(self) -> None:
        """Ask the worker to exit without waiting (an unload on the loop); `stop()` reaps and frees later."""
        if self._proc is not None and self._proc.poll() is None and self.socket is not None:
            try:
                sent = self._send_control(_SHUTDOWN)
            except zmq.ZMQError:
                sent = False
            if not sent:
                self.kill()  # nobody reads the socket: nothing to wait for

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL the worker (chaos harness, hung worker). stop() still has to run."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.kill()
            except ProcessLookupError:
                pass

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def pollables(self) -> list:
        """What the loop polls for this link: the control socket and the result doorbell."""
        return [self.socket, self.result_fd]

    def _cleanup(self) -> None:
        if self.result_fd is not None:
            os.close(self.result_fd)
            self.result_fd = None
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass
            self._ipc_path = None
        for ring in (self._job_ring, self._result_ring):
            if ring is None:
                continue
            try:
                ring.unlink()
            except (FileNotFoundError, OSError):
                pass  # the worker unlinks them itself when it outlives us
            ring.close()
        self._job_ring = self._result_ring = None
        if self._bell is not None:
            self._bell.close()
            self._bell.unlink()
            self._bell = None
        self._proc = None
        self.pid = None
        self.info = None

    # -- traffic -------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Write the job record into the job ring and ring the doorbell. Raises ipc.ring.RingFull."""
        assert self._job_ring is not None and self.socket is not None, "submit() on a stopped ChipLink"
        job.submitted_ns = time.monotonic_ns()
        spec = job.array_spec()
        spec["ctl"] = _CTL_SPEC
        with self._job_ring.reserve(spec, timeout=0.0) as w:  # packed straight into the ring: one copy
            dst = w.arrays
            job.pack_into(dst)
            dst["ctl"][0] = self._ctl_sent
        assert self._bell is not None
        self._bell.ring()

    def ring_layout_stats(self) -> dict | None:
        """The daemon's ends of this link's rings: the job ring's write-side layout cache and the result ring's
        read-side one (entries, max_entries, hits, misses); None while stopped."""
        if self._job_ring is None or self._result_ring is None:
            return None
        return {"job": self._job_ring.layout_cache_stats("write"),
                "result": self._result_ring.layout_cache_stats("read")}

    def _send_control(self, data: bytes) -> bool:
        """Send a control message (NOBLOCK) and wake the worker for it; False when it could not be sent.

        A worker that cannot take it (dead before the supervisor noticed, or 10,000 messages behind) has
        lost a message later jobs depend on: the link reports the worker failed, and a restarted worker
        starts with none of the state the message was about.
        """
        assert self.socket is not None and self._bell is not None
        try:
            self.socket.send(data, zmq.NOBLOCK)
        except zmq.Again:
            self._control_lost = True
            return False
        self._ctl_sent += 1
        self._bell.ring()
        return True

    def release_blocks(self, blocks: list[int]) -> None:
        """Tell the worker these KV blocks were freed; it applies this before any job submitted later."""
        assert self.socket is not None, "release_blocks() on a stopped ChipLink"
        self._send_control(encode(Msg.RELEASE, blocks=[int(b) for b in blocks]))

    def attach_kv_pool(self, fields: dict) -> None:
        """Give the worker the board's host KV pool and disk tier (it applies this before any later job)."""
        assert self.socket is not None, "attach_kv_pool() on a stopped ChipLink"
        self._send_control(encode(Msg.KV_POOL, **fields))

    def lora_add(self, number: int, path: str, sha256: str) -> None:
        """Register a LoRA adapter with the worker (jobs submitted after this may name `number`)."""
        assert self.socket is not None, "lora_add() on a stopped ChipLink"
        self._send_control(encode(Msg.LORA_ADD, id=int(number), path=path, sha256=sha256))

    def lora_drop(self, number: int) -> None:
        """Drop an adapter (the worker applies it before any job submitted after this)."""
        assert self.socket is not None, "lora_drop() on a stopped ChipLink"
        self._send_control(encode(Msg.LORA_DROP, id=int(number)))

    def chaos(self, action: str, seconds: float = 0.0) -> None:
        """Test hook: "crash", "hang" (for `seconds`) or "slow" (`seconds` added to every job)."""
        assert self.socket is not None, "chaos() on a stopped ChipLink"
        act = ChaosAction(action)
        self._send_control(encode(Msg.CHAOS, action=act.value, seconds=float(seconds)))

    def handle_events(self) -> list[LinkEvent]:
        """Drain control messages, the result doorbell and the result ring without blocking."""
        events: list[LinkEvent] = []
        if self.socket is None:
            return events
        heartbeat: Heartbeat | None = None
        sock = self.socket
        # Asking EVENTS first: a failed recv costs an exception, on every call.
        while sock.get(zmq.EVENTS) & _POLLIN:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.last_heartbeat = time.monotonic()
            if data.startswith(_RESULT_PREFIX):
                continue
            try:
                kind, msg = decode(data)
            except ControlError as exc:
                print(f"chip {self.chip}: dropped control message: {exc}", file=sys.stderr)
                continue
            if kind is Msg.READY:
                self.info = BackendInfo.from_dict(msg["info"])
                events.append(Ready(self.info, int(msg["pid"])))
            elif kind is Msg.FAILED:
                self._failure_reported = True
                events.append(WorkerFailed(str(msg["message"])))
            elif kind is Msg.HEARTBEAT:
                heartbeat = Heartbeat(float(msg["at"]), int(msg["jobs_done"]), int(msg.get("busy_job", -1)))
                if type(msg.get("lora")) is dict:
                    self.lora_stats = msg["lora"]  # the worker's adapter slots, swaps, swap seconds
            # RESULT and BYE only wake us; results are read from the ring below.
        # The doorbell is emptied BEFORE the ring is read: the worker commits a record before it
        # rings, so a record this drain misses rang after the read below and leaves the fd readable.
        try:
            os.read(self.result_fd, 8)  # an eventfd: one read takes the whole count
        except BlockingIOError:
            pass
        results = self._drain_results()
        if results:
            self.last_heartbeat = time.monotonic()  # a result is a sign of life, as its message was
            for r in results:
                events.append(Result(r))
        if heartbeat is not None:
            events.append(heartbeat)
        if self._control_lost and not self._failure_reported:
            self._failure_reported = True
            events.append(WorkerFailed("the worker took no control message (it died, or fell 10,000 behind)"))
        if self.info is None and not self._failure_reported and self._proc is not None:
            rc = self._proc.poll()
            if rc is not None:
                self._failure_reported = True
                events.append(WorkerFailed(f"worker exited with status {rc} before it was ready"))
        return events

    def _drain_results(self) -> list[JobResult]:
        ring = self._result_ring
        out: list[JobResult] = []
        if ring is None:
            return out
        while (rec := ring.peek()) is not None:
            try:
                out.append(JobResult.from_arrays(rec))  # copies out of the ring
            finally:
                del rec
                ring.release()
        return out

    # -- context manager for tests and tools ---------------------------------
    def __enter__(self) -> "ChipLink":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
