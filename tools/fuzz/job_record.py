"""Harness: ring records -> `ipc.records.Job.from_arrays` / `Job.validate` (the worker's side) and
`JobResult.from_arrays` (the daemon's side).

Contract (ipc/records.py): a record whose arrays disagree with its meta is a `ValueError` from
`from_arrays`; a job that is not coherent is a `ValueError` from `validate` (the worker answers it
INVALID and keeps serving). Any other exception is a finding, and so is a job that passes `validate`
but whose lanes cannot be read or which does not survive `to_arrays` -> `from_arrays` unchanged.

Input bytes: a flag byte (bit 0: a result record; bit 1: decode the job with copy=True; bits 2-5: the
result's optional arrays), then each array's dimensions (u16), then the arrays' bytes (zero padded).
"""

from __future__ import annotations

import struct

import numpy as np

from ipc.records import Job, JobKind, JobResult, JobStatus, Lane, build_job, decode_job
from tools.fuzz.finding import Finding

_JOB = (("meta", "<i8", 1), ("i32", "<i4", 1), ("f32", "<f4", 1), ("u8", "|u1", 1), ("u64", "<u8", 1))
_RESULT = (("meta", "<i8", 1), ("tokens", "<i4", 1), ("logprobs", "<f4", 1), ("logits", "<f4", 2),
           ("accepted", "<i4", 1), ("accepted_logprobs", "<f4", 1), ("accepted_tokens", "<i4", 1))
_OPTIONAL = ("logits", "accepted", "accepted_logprobs", "accepted_tokens")
MAX_ELEMENTS = 1 << 14


def encode(arrays: dict, result: bool, copy: bool = False) -> bytes:
    """The harness's byte form of one record (the seeds)."""
    spec = _RESULT if result else _JOB
    flags = int(result) | int(copy) << 1
    for i, name in enumerate(_OPTIONAL):
        if result and name in arrays:
            flags |= 1 << (2 + i)
    head, body = bytes([flags]), b""
    for name, dt, ndim in spec:
        if name in arrays:
            a = np.ascontiguousarray(arrays[name], dtype=dt)
            head += struct.pack(f"<{ndim}H", *(a.shape if a.ndim == ndim else (a.size,) + (1,) * (ndim - 1)))
            body += a.tobytes()
    return head + body


def decode(data: bytes) -> tuple[dict, bool, bool]:
    if not data:
        return {}, False, False
    flags, pos = data[0], 1
    result = bool(flags & 1)
    spec = _RESULT if result else _JOB
    shapes = []
    for name, dt, ndim in spec:
        if result and name in _OPTIONAL and not flags & (1 << (2 + _OPTIONAL.index(name))):
            continue
        dims = struct.unpack("<%dH" % ndim, data[pos:pos + 2 * ndim].ljust(2 * ndim, b"\0"))
        pos += 2 * ndim
        if np.prod(dims, dtype=np.int64) > MAX_ELEMENTS:
            dims = (0,) * ndim
        shapes.append((name, np.dtype(dt), dims))
    arrays = {}
    for name, dt, dims in shapes:
        n = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
        raw = data[pos:pos + n].ljust(n, b"\0")
        pos += n
        a = np.frombuffer(raw, dt).reshape(dims)
        a.flags.writeable = False  # ring views are read-only
        arrays[name] = a
    return arrays, result, bool(flags & 2)


def _seeds() -> list[bytes]:
    lanes = [Lane([1, 2, 3], 0, [0]), None, Lane([7, 8], 4, [1, 2], temperature=0.5, top_p=0.9, top_k=5, seed=3,
                                                     want_logprobs=True)]
    jobs = [
        build_job(JobKind.PREFILL, lanes, job_id=1, generation=2),
        build_job(JobKind.PREFILL, [Lane([1, 2, 3, 4], 0, [0], drafts=2, draft_model=True)], job_id=3),
        build_job(JobKind.PREFILL, [Lane([5, 6], 0, [3], constraint=9, constraint_key=4, replay=[1],
                                         grammar="start: \"a\"")], batch=2, job_id=4),
        decode_job([4, 5], [3, 9], [[0], [1, 2]], [(0.0, 1.0, 0, 0, False), (1.0, 0.5, 3, 7, True)], batch=4,
                   decode_steps=2, queue_next_step=True),
        Job.kv_copy(5, 1, [0, 1], [2, 3]),
        Job.kv_copy(6, 1, [4], [0], kind=JobKind.KV_EXPORT),
    ]
    out = [encode(j.to_arrays(), False, copy=bool(i % 2)) for i, j in enumerate(jobs)]
    results = [
        JobResult(1, 2, JobKind.PREFILL, JobStatus.OK, np.array([5, -1, 7], np.int32),
                  np.array([-0.5, 0, -1], np.float32), device_us=10, worker_us=20, idle_us=3),
        JobResult(2, 2, JobKind.DECODE, JobStatus.OK, np.array([5], np.int32), np.zeros(1, np.float32),
                  logits=np.zeros((1, 4), np.float32), accepted=np.array([2], np.int32),
                  accepted_logprobs=np.array([-0.1, -0.2], np.float32), accepted_tokens=np.array([3, 4], np.int32)),
        JobResult(3, 1, JobKind.KV_COPY, JobStatus.INVALID, np.zeros(0, np.int32), np.zeros(0, np.float32)),
    ]
    out += [encode(r.to_arrays(), True) for r in results]
    return out


SEEDS = _seeds()


def _same(a, b, what: str) -> None:
    for name, x in vars(a).items():
        y = getattr(b, name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            same = x is None and y is None or (x is not None and y is not None and x.shape == y.shape
                                               and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"))
        else:
            same = x == y
        if not same:
            raise Finding(f"{what} changed on to_arrays -> from_arrays: {name} | {x!r:.120} -> {y!r:.120}")


def _job(arrays: dict, copy: bool) -> None:
    try:
        job = Job.from_arrays(arrays, copy=copy)
    except ValueError:
        return  # the documented refusal of a record whose sizes disagree with its meta
    try:
        job.validate()
    except ValueError:
        return  # the worker answers INVALID
    if job.kind not in (JobKind.KV_COPY, JobKind.KV_EXPORT, JobKind.KV_IMPORT):
        qs = job.query_start
        for lane in range(job.batch):
            n = int(qs[lane + 1]) - int(qs[lane])
            if n < 0 or len(job.lane_tokens(lane)) != n or len(job.lane_positions(lane)) != n:
                raise Finding(f"a validated job's lane does not read back | lane {lane} of {job!r:.300}")
            if job.constrained:
                job.lane_replay(lane)
    _same(job, Job.from_arrays(job.to_arrays()), "a validated job")


def _result(arrays: dict) -> None:
    try:
        res = JobResult.from_arrays(arrays)
    except ValueError:
        return  # an unknown kind or status, a short meta
    if not isinstance(res.kind, JobKind) or not isinstance(res.status, JobStatus):
        raise Finding(f"a result decoded with a kind or status outside the enums | {res!r:.300}")
    if (res.accepted is None) != (res.accepted_logprobs is None) or (
            res.accepted is None and res.accepted_tokens is not None):
        return  # a record our writer never makes (accepted_* travel with accepted): no round trip to compare
    _same(res, JobResult.from_arrays(res.to_arrays()), "a result")


def one_input(data: bytes) -> None:
    arrays, result, copy = decode(data)
    if not arrays:
        return
    if result:
        _result(arrays)
    else:
        _job(arrays, copy)
