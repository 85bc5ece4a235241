"""Control messages between a chip's link (scheduler side) and its worker process.

One orjson object per ZeroMQ message over a PAIR socket on ipc://. Messages
only announce and steer: tensors travel in the shared-memory rings, so a
message never carries a job's arrays, only the fact that ring records exist.
Every message has `"v": 1` and a `"msg"` name from `Msg`.

Link -> worker: JOB (doorbell: records are waiting in the job ring; only
used when the link has no semaphore doorbell), SHUTDOWN, CHAOS (test hooks for
the chaos harness), RELEASE (KV blocks the scheduler freed: a backend with
its own KV store, llama.cpp, frees their cells). The hot path, a new job, rings a POSIX semaphore instead
(`WorkerConfig.job_bell`): one futex wake instead of four ZeroMQ thread hops.
Because the semaphore and the socket are not ordered with each other, every
job record carries `ctl` = the number of control messages the link had sent
before it; the worker reads that many before it runs the job, so "slow" or
"hang" always applies to the jobs submitted after it.
Worker -> link: READY (BackendInfo.to_dict()), FAILED (start-up failure),
HEARTBEAT, RESULT (doorbell: records are waiting in the result ring; only
used when the link passed no result doorbell fd), BYE. The hot path back, a
finished job, writes to an eventfd instead (`WorkerConfig.result_bell_fd`):
one syscall that the link's zmq.Poller sees directly, instead of a ZeroMQ
send, an I/O-thread hop and a recv.

The worker's launch configuration (`WorkerConfig`) is also defined here: it is
the one message that travels on the command line instead of the socket, and
so is its environment (`worker_environ`): one BLAS thread per worker unless
told otherwise. Each chip has a worker, and a BLAS pool per worker on a small
host only makes workers, the scheduler and ZeroMQ's I/O threads fight for
cores (OpenBLAS threads busy-wait after each call); a tiny model gains
nothing from them either.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from ipc.ring import DEFAULT_LAYOUT_CACHE_ENTRIES

VERSION = 1


class Msg(str, enum.Enum):
    # link -> worker
    JOB = "job"
    SHUTDOWN = "shutdown"
    CHAOS = "chaos"
    RELEASE = "release"  # the scheduler freed these KV blocks (`blocks`); see ChipBackend.release_blocks
    KV_POOL = "kv_pool"  # attach the board's host KV pool (`name`, `slots`, `slot_bytes`) for transfer jobs
    LORA_ADD = "lora_add"  # a LoRA adapter jobs may name (`id`: its board number, `path`, `sha256`)
    LORA_DROP = "lora_drop"  # forget adapter `id` (applied before the jobs submitted after it)
    # worker -> link
    READY = "ready"
    FAILED = "failed"
    HEARTBEAT = "heartbeat"
    RESULT = "result"
    BYE = "bye"


class ChaosAction(str, enum.Enum):
    CRASH = "crash"  # die at once without cleanup (SIGKILL self)
    HANG = "hang"  # answer nothing, heartbeats included, for `seconds`
    SLOW = "slow"  # add `seconds` to every job from now on (0 turns it off)


class ControlError(ValueError):
    """A control message that cannot be decoded or lacks a required field."""


_REQUIRED: dict[Msg, tuple[str, ...]] = {
    Msg.JOB: (),
    Msg.SHUTDOWN: (),
    Msg.CHAOS: ("action", "seconds"),
    Msg.RELEASE: ("blocks",),
    Msg.KV_POOL: ("name", "slots", "slot_bytes"),
    Msg.LORA_ADD: ("id", "path", "sha256"),
    Msg.LORA_DROP: ("id",),
    Msg.READY: ("info", "pid"),
    Msg.FAILED: ("message",),
    Msg.HEARTBEAT: ("at", "jobs_done"),
    Msg.RESULT: ("job_id",),
    Msg.BYE: (),
}


def encode(kind: Msg, **fields: Any) -> bytes:
    missing = [f for f in _REQUIRED[kind] if f not in fields]
    assert not missing, f"{kind.value} message lacks {missing}"
    return orjson.dumps({"v": VERSION, "msg": kind.value, **fields})


def decode(data: bytes) -> tuple[Msg, dict[str, Any]]:
    """Return (kind, message); raise ControlError for anything malformed."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ControlError(f"control message is not JSON: {exc}") from None
    if not isinstance(obj, dict) or obj.get("v") != VERSION:
        raise ControlError(f"control message without version {VERSION}: {data[:80]!r}")
    try:
        kind = Msg(obj.get("msg"))
    except ValueError:
        raise ControlError(f"unknown control message {obj.get('msg')!r}") from None
    missing = [f for f in _REQUIRED[kind] if f not in obj]
    if missing:
        raise ControlError(f"{kind.value} message lacks {missing}")
    if kind is Msg.CHAOS:
        try:
            ChaosAction(obj["action"])
        except ValueError:
            raise ControlError(f"unknown chaos action {obj['action']!r}") from None
    if kind is Msg.RELEASE and not (isinstance(obj["blocks"], list)
                                    and all(type(b) is int and b >= 0 for b in obj["blocks"])):
        raise ControlError(f"release message: blocks must be a list of block ids, not {obj['blocks']!r:.80}")
    if kind in (Msg.LORA_ADD, Msg.LORA_DROP) and not (type(obj["id"]) is int and 0 <= obj["id"] < 2**31):
        raise ControlError(f"{kind.value} message: id must be an adapter number, not {obj['id']!r:.80}")
    if kind is Msg.LORA_ADD and not (isinstance(obj["path"], str) and isinstance(obj["sha256"], str)):
        raise ControlError("lora_add message: path and sha256 must be strings")
    return kind, obj


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs to start; passed as JSON on argv."""

    board: str
    chip: int
    backend: str
    job_ring: str
    result_ring: str
    control_endpoint: str
    parent_pid: int
    backend_options: dict = field(default_factory=dict)
    package_path: str | None = None
    package_sha256: str | None = None  # the daemon verified this package for this load: not hashed again
    heartbeat_interval_s: float = 0.2
    job_bell: str | None = None  # POSIX semaphore rung after each job record (None: poll the socket)
    # How long the worker polls its doorbell before it parks in the kernel. Longer
    # than the doorbell's default (ipc.doorbell.DEFAULT_SPIN_S, 50 us) so that it
    # outlasts a busy link's turnaround (~0.1-0.2 ms): a parked worker costs the
    # link a futex wake-up per job and itself a cold-cache start. Measured on a
    # 2-core host: +3 points of worker/in-process decode throughput on average
    # (bench-backend, 7 paired runs, 5 better), about equal total CPU when quiet;
    # on saturated cores it costs instead (64 stub streams on 2 cores: 0.83-0.95x
    # the tokens/s of no spin, docs/architecture.md), so the worker's doorbell is
    # adaptive: it spins only while most recent waits ended within this window.
    job_spin_s: float = 200e-6
    # An eventfd inherited from the link (same number in the worker): the worker
    # adds 1 to it after each result record. None: send a RESULT message instead.
    result_bell_fd: int | None = None
    ring_layout_cache_entries: int = DEFAULT_LAYOUT_CACHE_ENTRIES  # record shapes each ring end keeps the layout of

    def to_json(self) -> str:
        return orjson.dumps(asdict(self)).decode()

    @classmethod
    def from_json(cls, text: str) -> "WorkerConfig":
        return cls(**orjson.loads(text))


# Read by the BLAS libraries when they load, so they must be in the worker's launch environment.
BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
WORKER_BLAS_THREADS_VAR = "NPUSERVE_WORKER_BLAS_THREADS"
DEFAULT_WORKER_BLAS_THREADS = 1


def worker_environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a worker process starts with: `base` (default os.environ) plus its BLAS threads.

    NPUSERVE_WORKER_BLAS_THREADS=N sets every BLAS variable to N. Otherwise,
    when none of them is set, they are set to 1; when the operator set one,
    the environment is passed on unchanged.
    """
    env = dict(os.environ if base is None else base)
    forced = env.get(WORKER_BLAS_THREADS_VAR)
    if forced is not None:
        n = int(forced)
        if n < 1:
            raise ValueError(f"{WORKER_BLAS_THREADS_VAR} must be >= 1, not {forced!r}")
        env.update({v: str(n) for v in BLAS_THREAD_VARS})
    elif not any(v in env for v in BLAS_THREAD_VARS):
        env.update({v: str(DEFAULT_WORKER_BLAS_THREADS) for v in BLAS_THREAD_VARS})
    return env

