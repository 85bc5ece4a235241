"""The per-chip worker process: the only place that calls a chip runtime.

Started by `engine.daemon.chip_link.ChipLink` as `python -m workers CONFIG_JSON`.
It attaches the chip's two rings (jobs in, results out), loads the backend,
announces READY, then serves: job records are read as zero-copy ring views,
run through the backend (and sampling, when the backend returns logits:
workers/execute_job.py), and answered with a JobResult record written straight into reserved result-ring
space, then a write to the link's result doorbell (an eventfd). A failing backend call fails that job only; the worker stays up.

It exits on a SHUTDOWN message, on SIGTERM, and on its parent's death (which
it notices through PR_SET_PDEATHSIG (SIGUSR1) and by polling its parent pid every loop
turn); when the parent is gone it also unlinks the rings, since nobody else
will.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import time

import numpy as np
import orjson
import zmq

from ipc.doorbell import SemaphoreDoorbell
from ipc.kv_slots import KvSlotPool
from ipc.lane_imports import CAPABILITY as LANE_IMPORTS
from ipc.records import RESULT_META_LEN, Job, JobStatus, ResultMeta
from ipc.ring import RecordTooLarge, Ring, RingFull
from workers.backends.base import ChipBackend
from workers.constraints import ConstraintBook, ConstraintError, lltokenizer_for
from workers.control import ChaosAction, ControlError, Msg, WorkerConfig, decode, encode
from workers.draft_model import DraftModel
from workers.execute_job import JobOutcome, execute_job
from workers.heap_snapshots import install as install_heap_snapshots
from workers.queued_step_tokens import QueuedStepTokens, UnresolvedQueuedStep
from workers.kv_transfer import HostKv
from workers.penalties import PenaltyBook
from workers.lora.adapter_book import AdapterBook, AdapterError

_PR_SET_PDEATHSIG = 1
_PARENT_DEATH_SIGNAL = signal.SIGUSR1
_BELL_ONE = (1).to_bytes(8, "little")  # an eventfd takes one native u64 per write (a pipe takes any bytes)
_FAILED_SEND_LINGER_MS = 2000
_POLLIN = int(zmq.POLLIN)  # a plain int: `&` with the IntFlag member runs enum Python code every loop turn


def _log(event: str, **fields) -> None:
    """One structured JSON line on stderr (the daemon's journal)."""
    sys.stderr.write(orjson.dumps({"event": event, "pid": os.getpid(), **fields}).decode() + "\n")
    sys.stderr.flush()


def _set_parent_death_signal(sig: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the getppid() poll still notices the parent's death


class _Terminate(BaseException):
    """Raised by the SIGTERM handler; BaseException so no job handler swallows it."""


class _ParentDied(_Terminate):
    """Raised on PR_SET_PDEATHSIG's own signal: the thread that started us died.

    A signal of its own, not SIGTERM: while the dying parent still has live
    threads (ZeroMQ's I/O threads), getppid() does not change yet, so only the
    signal itself says the parent is going and the rings are ours to unlink.
    """


class WorkerProcess:
    """The serve loop of one worker; owns its socket, rings and backend."""

    def __init__(self, config: WorkerConfig, sock: zmq.Socket, job_ring: Ring, result_ring: Ring, backend: ChipBackend,
                 bell: SemaphoreDoorbell | None = None, result_fd: int | None = None,
                 constraints: ConstraintBook | None = None):
        self.config = config
        self.constraints = constraints
        self.penalties = PenaltyBook()  # penalised requests' token counts (workers/penalties.py)
        self.sock = sock
        self.job_ring = job_ring
        self.result_ring = result_ring
        self.backend = backend
        self.draft: DraftModel | None = None  # the chip's draft model (speculative.draft_package)
        self.bell = bell
        self.result_fd = result_fd  # the link's result doorbell (an eventfd); None: RESULT messages
        self.jobs_done = 0
        self.ctl_seen = 0  # control messages received (jobs carry how many precede them)
        self._releases: list[tuple[int, list[int]]] = []  # (control message index, blocks) not applied yet
        self.slow_s = 0.0
        self._device_end_ns = 0  # time.monotonic_ns() when the last backend call ended (0: none yet)
        self._occupancy = (0, -1)  # (device_start_ns, idle_us) of the job being answered
        self.queued_step_tokens = QueuedStepTokens(backend.describe().kv.block_size)  # queued next steps' input tokens
        self.host_kv: HostKv | None = None  # the board's host KV pool, once the link sent KV_POOL
        slots = int((backend.describe().extra.get("lora") or {}).get("slots", 0))
        max_loaded, max_cached = (config.backend_options or {}).get(LORA_OPTION, DEFAULT_LORA_LIMITS)
        self.adapters = AdapterBook(backend, min(slots, int(max_loaded)), int(max_cached))
        self._lora_drops: list[tuple[int, int]] = []  # (control message index, adapter) not applied yet
        self.running = True
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.interval = config.heartbeat_interval_s
        self.next_heartbeat = 0.0
        # A runtime that holds this thread for seconds (llama.cpp prefill on a busy CPU) would look dead:
        # while a job runs, a helper thread heartbeats instead. It uses the socket only while `_in_job`
        # is set under `_sock_lock`, and the main thread does not touch the socket during a job.
        self._in_job = False
        self._sock_lock = threading.Lock()
        if getattr(backend, "holds_thread_in_calls", False):
            threading.Thread(target=self._job_heartbeats, name="job-heartbeat", daemon=True).start()

    # -- messaging -------------------------------------------------------
    def send(self, data: bytes) -> None:
        try:
            self.sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            # The link is not reading. Dropping is safe: the link drains the
            # whole result ring on any wake-up, and a full queue wakes it.
            pass

    def ring_result_bell(self, job_id: int) -> None:
        """Wake the link after a result record is committed (never before: the ring is the truth)."""
        fd = self.result_fd
        if fd is None:
            self.send(encode(Msg.RESULT, job_id=job_id))
            return
        try:
            os.write(fd, _BELL_ONE)
        except BlockingIOError:
            pass  # the counter (or pipe) is full of unread wake-ups: the link is already woken

    def parent_alive(self) -> bool:
        return os.getppid() == self.config.parent_pid

    def heartbeat_if_due(self) -> None:
        now = time.monotonic()
        if now >= self.next_heartbeat:
            extra = {"lora": self.adapters.stats()} if self.adapters.registered or self.adapters.swaps else {}
            self.send(encode(Msg.HEARTBEAT, at=now, jobs_done=self.jobs_done, **extra))
            self.next_heartbeat = now + self.interval

    def _job_heartbeats(self) -> None:
        while self.running:
            time.sleep(self.interval)
            with self._sock_lock:
                if self._in_job:
                    self.send(encode(Msg.HEARTBEAT, at=time.monotonic(), jobs_done=self.jobs_done))

    def _set_in_job(self, value: bool) -> None:
        with self._sock_lock:
            self._in_job = value

    def drain_control(self) -> None:
        sock = self.sock
        # Asking EVENTS first: it runs on every loop turn, and a failed recv costs an exception.
        while self.running and sock.get(zmq.EVENTS) & _POLLIN:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                kind, msg = decode(data)
            except ControlError as exc:
                _log("worker.bad_control", error=str(exc))
                continue
            self.ctl_seen += 1
            if kind is Msg.SHUTDOWN:
                self.running = False
            elif kind is Msg.CHAOS:
                self.chaos(ChaosAction(msg["action"]), float(msg["seconds"]))
            elif kind is Msg.KV_POOL:
                self.attach_host_pool(msg["name"], int(msg["slots"]), int(msg["slot_bytes"]), msg.get("disk_dir"))
            elif kind is Msg.RELEASE:
                # Applied just before the first job submitted after it (apply_releases): a job already in
                # the ring may still read these blocks (a request cancelled while its job was in flight).
                self._releases.append((self.ctl_seen - 1, msg["blocks"]))
            elif kind is Msg.LORA_ADD:
                self.adapters.add(msg["id"], msg["path"], msg["sha256"])
            elif kind is Msg.LORA_DROP:  # like RELEASE: a job already in the ring may still name it
                self._lora_drops.append((self.ctl_seen - 1, msg["id"]))
            # JOB is only a doorbell: the serve loop reads the ring every turn.

    def attach_host_pool(self, name: str | None, slots: int, slot_bytes: int, disk_dir: str | None) -> None:
        """Map the board's host KV pool and note the disk tier's directory (for transfer jobs after this
        message); a failure leaves neither (transfer jobs are then refused and the scheduler recomputes)."""
        old, self.host_kv = self.host_kv, None
        if old is not None and old.pool is not None:
            old.pool.close()
        try:
            pool = KvSlotPool.attach(name, slots, slot_bytes) if name else None
            self.host_kv = HostKv(pool, self.backend, self.backend.describe(), disk_dir)
        except Exception as exc:  # transfer jobs are then answered INVALID and the scheduler recomputes
            _log("worker.kv_pool_failed", error=f"{type(exc).__name__}: {exc}")

    def apply_releases(self, sent_before: int) -> None:
        """Give the backend the release notices sent before the job about to run (and none sent after it)."""
        while self._releases and self._releases[0][0] < sent_before:
            _, blocks = self._releases.pop(0)
            try:
                self.backend.release_blocks(blocks)
                if self.draft is not None:
                    self.draft.release_blocks(blocks)
            except Exception as exc:  # a backend bug must not kill the worker; the next job's checks stand
                _log("worker.release_failed", error=f"{type(exc).__name__}: {exc}")

    def apply_lora_drops(self, sent_before: int) -> None:
        """Drop the adapters unloaded before the job about to run (`sent_before` control messages). With the
        job ring empty every job sent before a drop has run (a job is in the ring before the link sends the
        next control message), so they all go."""
        while self._lora_drops and self._lora_drops[0][0] < sent_before:
            self.adapters.drop(self._lora_drops.pop(0)[1])

    def catch_up_control(self, sent_before: int) -> None:
        """Read the control messages the link sent before this job (they may still be in flight)."""
        deadline = time.monotonic() + 2.0
        while self.running and self.ctl_seen < sent_before and time.monotonic() < deadline:
            if self.sock.poll(50):
                self.drain_control()
            self.heartbeat_if_due()

    def chaos(self, action: ChaosAction, seconds: float) -> None:
        _log("worker.chaos", action=action.value, seconds=seconds)
        if action is ChaosAction.CRASH:
            os.kill(os.getpid(), signal.SIGKILL)
        elif action is ChaosAction.HANG:
            end = time.monotonic() + seconds
            while time.monotonic() < end and self.parent_alive():
                time.sleep(min(0.05, max(0.0, end - time.monotonic())))
        elif action is ChaosAction.SLOW:
            self.slow_s = max(0.0, seconds)

    # -- jobs ------------------------------------------------------------
    def serve_jobs(self) -> None:
        while self.running and self.parent_alive():
            rec = self.job_ring.peek()
            if rec is None:
                return
            if "ctl" in rec and (sent_before := int(rec["ctl"][0])) > self.ctl_seen:
                self.catch_up_control(sent_before)
                if not self.running:
                    return
            if self._releases:
                self.apply_releases(int(rec["ctl"][0]) if "ctl" in rec else self.ctl_seen)
            if self._lora_drops:
                self.apply_lora_drops(int(rec["ctl"][0]) if "ctl" in rec else self.ctl_seen)
            t0 = time.perf_counter_ns()
            job = Job.from_arrays(rec, copy=False)  # read-only ring views: the backend keeps none
            if self.slow_s > 0:  # chaos only: say which job is now on the "device", so a test can act mid-job
                self.send(encode(Msg.HEARTBEAT, at=time.monotonic(), jobs_done=self.jobs_done, busy_job=job.job_id))
            self._set_in_job(True)
            start_ns = time.monotonic_ns()
            try:
                try:
                    self.queued_step_tokens.resolve(job)
                    if job.adapter.size:
                        job.adapter = self.adapters.slots_for(job.adapter)
                except (UnresolvedQueuedStep, AdapterError) as exc:
                    b = job.batch
                    outcome = JobOutcome(JobStatus.INVALID, np.full(b, -1, np.int32), np.zeros(b, np.float32), None,
                                         0, f"invalid job: {exc}")
                else:
                    outcome = execute_job(self.backend, job, self.slow_s, self.host_kv, self.constraints, self.draft,
                                          self.penalties)
                    if job.queue_next_step and outcome.status == JobStatus.OK:  # a step may be queued behind its lanes
                        self.queued_step_tokens.record(job, outcome.tokens)
            finally:
                self._set_in_job(False)
            # the chip's idle gap before this job: what keeping the chip busy is measured by (chip_occupancy)
            last, self._device_end_ns = self._device_end_ns, time.monotonic_ns()
            self._occupancy = (start_ns, -1 if last == 0 else max(0, start_ns - last) // 1000)
            self.write_result(job, outcome, t0)
            # Wake the link first: the bookkeeping below overlaps its wake-up.
            self.ring_result_bell(job.job_id)
            self.jobs_done += 1
            if outcome.error:
                _log("worker.job_failed", job_id=job.job_id, status=outcome.status.name, error=outcome.error)
            del job, rec  # drop the views before the ring may reuse their space
            self.job_ring.release()
            self.heartbeat_if_due()
            self.drain_control()

    def write_result(self, job: Job, outcome: JobOutcome, t0_ns: int) -> None:
        b = job.batch
        logits = outcome.logits
        status = outcome.status
        accepted = outcome.accepted if status == JobStatus.OK else None
        extra = outcome.extra if status == JobStatus.OK else None
        spec = _result_spec(b, None if logits is None else logits.shape, job.decode_steps,
                            -1 if accepted is None else int(accepted.sum()))
        if extra:  # lanes asking for alternatives or prompt logprobs (the rare path: a copy of the cached spec)
            spec = {**spec, **{k: (v.shape, v.dtype.str) for k, v in extra.items()}}
        while True:
            try:
                writer = self.result_ring.reserve(spec, timeout=self.interval)
                break
            except RecordTooLarge:
                _log("worker.result_too_large", job_id=job.job_id, shape=list(logits.shape) if logits is not None else None)
                spec = _result_spec(b, None, job.decode_steps)
                logits, status, accepted, extra = None, JobStatus.FAILED, None, None
                outcome.tokens[:] = -1
                outcome.logprobs[:] = 0
            except RingFull:
                # The link is not draining results; stay visibly alive meanwhile.
                self.heartbeat_if_due()
                self.drain_control()
                if not self.running or not self.parent_alive():
                    return
        S = ResultMeta
        with writer:
            a = writer.arrays
            meta = a["meta"]
            meta[S.JOB_ID] = job.job_id
            meta[S.GENERATION] = job.generation
            meta[S.KIND] = job.kind
            meta[S.STATUS] = status
            meta[S.DEVICE_US] = outcome.device_us
            meta[S.MASKS] = outcome.masks
            meta[S.MASK_US] = outcome.mask_us
            meta[S.DEVICE_START_NS], meta[S.IDLE_US] = self._occupancy
            a["tokens"][:] = outcome.tokens
            a["logprobs"][:] = outcome.logprobs
            if logits is not None:
                a["logits"][...] = logits
            if accepted is not None:
                a["accepted"][:] = accepted
                a["accepted_logprobs"][:] = outcome.accepted_logprobs
                a["accepted_tokens"][:] = outcome.accepted_tokens
            if extra:
                for k, v in extra.items():
                    a[k][...] = v
            meta[S.WORKER_US] = (time.perf_counter_ns() - t0_ns) // 1000  # last: it times the whole write

    # -- loop ------------------------------------------------------------
    def serve(self) -> None:
        while self.running:
            if not self.parent_alive():
                _log("worker.parent_died", parent_pid=self.config.parent_pid)
                return
            self.heartbeat_if_due()
            if not len(self.job_ring):
                wait_s = max(0.0, self.next_heartbeat - time.monotonic())
                if self.bell is not None:
                    self.bell.wait(wait_s)
                else:
                    self.poller.poll(int(wait_s * 1000) + 1)
            self.drain_control()
            self.serve_jobs()
            if self._lora_drops and not len(self.job_ring):
                self.apply_lora_drops(self.ctl_seen)
        self.send(encode(Msg.BYE))


@functools.lru_cache(maxsize=256)
def _result_spec(b: int, logits_shape: tuple[int, ...] | None, steps: int = 1, n_accepted: int = -1) -> dict:
    """The ring spec of a JobResult record (cached: a worker sees few distinct shapes).

    Callers must not mutate it. dtype strings, not numpy types: the ring keys
    its layout cache on them.
    """
    shape = (b,) if steps <= 1 else (b, steps)  # multi-step decode: a row of tokens per lane
    spec: dict = {"meta": ((RESULT_META_LEN,), "<i8"), "tokens": (shape, "<i4"), "logprobs": (shape, "<f4")}
    if logits_shape is not None:
        spec["logits"] = (tuple(logits_shape), "<f4")
    if n_accepted >= 0:  # a verification job: accepted drafts per lane, their logprobs and tokens
        spec["accepted"] = ((b,), "<i4")
        spec["accepted_logprobs"] = ((n_accepted,), "<f4")
        spec["accepted_tokens"] = ((n_accepted,), "<i4")
    return spec


DRAFT_OPTION = "spec_draft_package"  # the backend option that names the draft model's package (not the backend's)
# the worker's (not the backend's) option: [lora.max_loaded_per_chip, lora.max_cached]
LORA_OPTION = "lora_limits"
DEFAULT_LORA_LIMITS = (8, 32)


def _load_backend(config: WorkerConfig):
    """(backend, package or None): the package's vocabulary also serves the constraint masks."""
    from workers.backends.registry import make_backend

    opts = dict(config.backend_options or {})
    opts.pop(DRAFT_OPTION, None)
    opts.pop(LORA_OPTION, None)
    backend = make_backend(config.backend, **opts)
    package = None
    if config.package_path is not None:
        from workers.package_loader import load_package

        package = load_package(config.package_path, verified_sha256=config.package_sha256)
    backend.load(package)
    return backend, package


def load_draft(config: WorkerConfig, target: ChipBackend) -> DraftModel | None:
    """The draft model of `backend_options[spec_draft_package]`: the target's backend kind, its KV geometry."""
    from workers.backends.registry import make_backend
    from workers.package_loader import load_package

    opts = dict(config.backend_options or {})
    path = opts.pop(DRAFT_OPTION, None)
    opts.pop(LORA_OPTION, None)
    if not path:
        return None
    info = target.describe()
    opts["num_blocks"] = info.kv.num_blocks
    if config.backend == "llamacpp":
        opts["block_size"] = info.kv.block_size
    draft = make_backend(config.backend, **opts)
    draft.load(load_package(path))
    d = draft.describe()
    if d.kv.block_size != info.kv.block_size or d.kv.num_blocks < info.kv.num_blocks or d.vocab_size != info.vocab_size:
        raise ValueError(f"draft package {path}: needs the target's vocabulary ({info.vocab_size}) and KV blocks "
                         f"({info.kv.num_blocks} of {info.kv.block_size}), has {d.vocab_size} and "
                         f"{d.kv.num_blocks} of {d.kv.block_size}")
    if not d.extra.get("spec_verify"):
        raise ValueError(f"backend {config.backend} cannot run a draft model")
    return DraftModel(draft)


def constraint_book(package, info) -> ConstraintBook:
    """The worker's constraint book; the llguidance tokenizer is built from the package on first use."""
    def make():
        from workers.tokenizer import load_tokenizer

        if package is None:
            raise ConstraintError("constrained lanes need a model package with a tokenizer")
        t0 = time.perf_counter()
        tok = lltokenizer_for(load_tokenizer(package), info.vocab_size, info.eos_ids)
        _log("worker.constraint_tokenizer", vocab=info.vocab_size, seconds=round(time.perf_counter() - t0, 3))
        return tok
    return ConstraintBook(make, info.vocab_size)


def _on_sigterm(signum, frame) -> None:
    raise _Terminate()


def _on_parent_death(signum, frame) -> None:
    raise _ParentDied()


def run(config: WorkerConfig) -> int:
    install_heap_snapshots(f"worker{config.chip}")  # opt-in ($NPUSERVE_TRACEMALLOC): a no-op otherwise
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(_PARENT_DEATH_SIGNAL, _on_parent_death)
    _set_parent_death_signal(_PARENT_DEATH_SIGNAL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the daemon, which stops us
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.connect(config.control_endpoint)
    rings: list[Ring] = []
    backend: ChipBackend | None = None
    bell: SemaphoreDoorbell | None = None
    parent_died = False
    try:
        if os.getppid() != config.parent_pid:
            parent_died = True
            return 0
        try:
            rings.append(Ring.attach(config.job_ring, config.ring_layout_cache_entries))
            rings.append(Ring.attach(config.result_ring, config.ring_layout_cache_entries))
            if config.job_bell is not None:
                bell = SemaphoreDoorbell.attach(config.job_bell, spin_s=config.job_spin_s, adaptive=True)
            backend, package = _load_backend(config)
            draft = load_draft(config, backend)
            info = backend.describe()
            if draft is not None:
                info.extra["spec_draft"] = True
            if info.kv_transfer is not None:  # it runs tier imports carried in prefill jobs (ipc.lane_imports)
                info.extra[LANE_IMPORTS] = True
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            _log("worker.start_failed", error=message)
            sock.setsockopt(zmq.LINGER, _FAILED_SEND_LINGER_MS)
            sock.send(encode(Msg.FAILED, message=message))
            return 1
        sock.send(encode(Msg.READY, info=info.to_dict(), pid=os.getpid()))
        worker = WorkerProcess(config, sock, rings[0], rings[1], backend, bell, config.result_bell_fd,
                               constraint_book(package, info))
        worker.draft = draft
        try:
            worker.serve()
        finally:
            parent_died = not worker.parent_alive()
        return 0
    except _Terminate as exc:
        parent_died = isinstance(exc, _ParentDied) or os.getppid() != config.parent_pid
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(_PARENT_DEATH_SIGNAL, signal.SIG_IGN)
        if backend is not None:
            try:
                backend.unload()
            except Exception as exc:
                _log("worker.unload_failed", error=f"{type(exc).__name__}: {exc}")
        for ring in rings:
            if parent_died:
                try:
                    ring.unlink()
                except Exception:
                    pass
            ring.close()
        if bell is not None:
            if parent_died:
                bell.unlink()
            bell.close()
        if config.result_bell_fd is not None:
            try:
                os.close(config.result_bell_fd)
            except OSError:
                pass
        sock.close()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m workers CONFIG_JSON (started by ChipLink, not by hand)", file=sys.stderr)
        return 2
    return run(WorkerConfig.from_json(argv[0]))
