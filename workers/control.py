"""Control messages between a chip's link (scheduler side) and its worker process.

One orjson object per ZeroMQ message over a PAIR socket on ipc://. Messages
only announce and steer: tensors travel in the shared-memory rings, so a
message never carries a job's arrays, only the fact that ring records exist.
Every message has `"v": 1` and a `"msg"` name from `Msg`.

Link -> worker: JOB (doorbell: records are waiting in the job ring; only
used when the link has no semaphore doorbell), SHUTDOWN, CHAOS (test hooks for
the chaos harness). The hot path, a new job, rings a POSIX semaphore instead
(`WorkerConfig.job_bell`): one futex wake instead of four ZeroMQ thread hops.
Because the semaphore and the socket are not ordered with each other, every
job record carries `ctl` = the number of control messages the link had sent
before it; the worker reads that many before it runs the job, so "slow" or
"hang" always applies to the jobs submitted after it.
Worker -> link: READY (BackendInfo.to_dict()), FAILED (start-up failure),
HEARTBEAT, RESULT (doorbell: records are waiting in the result ring), BYE.

The worker's launch configuration (`WorkerConfig`) is also defined here: it is
the one message that travels on the command line instead of the socket.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

VERSION = 1


class Msg(str, enum.Enum):
    # link -> worker
    JOB = "job"
    SHUTDOWN = "shutdown"
    CHAOS = "chaos"
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
    heartbeat_interval_s: float = 0.2
    job_bell: str | None = None  # POSIX semaphore rung after each job record (None: poll the socket)

    def to_json(self) -> str:
        return orjson.dumps(asdict(self)).decode()

    @classmethod
    def from_json(cls, text: str) -> "WorkerConfig":
        return cls(**orjson.loads(text))
