"""Harness: the bytes of one ring record -> `ipc.ring.Ring.peek` and its array views (what the worker
and the daemon read out of shared memory before `ipc.records` sees a field).

Contract (ipc/ring.py): "memory that is not a committed record raises `RingCorrupt` rather than being
returned". So `peek` returns a `Record` or raises `RingCorrupt`; any other exception is a finding, and
so is a returned record whose arrays cannot be read or lie outside its own bytes (over its header and
descriptor, or past its length into the next record).

The ring lives in process memory here (a bytearray in place of the shared-memory segment): the reader
code is the same, and the harness runs without /dev/shm.
"""

from __future__ import annotations

import os

import numpy as np

from ipc import ring as ring_mod
from ipc.records import JobResult, JobKind, JobStatus, Lane, build_job
from ipc.ring import ALIGN, HEADER_SIZE, Ring, RingCorrupt
from tools.fuzz.finding import Finding

CAPACITY = 1 << 14
_U64 = np.uint64


class _Memory:
    """The part of `ipc.shm.Segment` a Ring uses, over a bytearray."""

    def __init__(self, size: int) -> None:
        self.name = "fuzz-ring"
        self.size = size
        self.owner_pid = os.getpid()
        self._bytes = bytearray(size)
        self.buf = memoryview(self._bytes)

    def close(self) -> None:
        pass

    def unlink(self) -> None:
        pass


def _fresh() -> tuple[_Memory, Ring]:
    mem = _Memory(HEADER_SIZE + CAPACITY)
    hdr = np.ndarray((HEADER_SIZE // 8,), _U64, buffer=mem.buf)
    hdr[ring_mod._WRAP_FROM] = ring_mod._NO_WRAP
    hdr[ring_mod._CAPACITY] = CAPACITY
    hdr[ring_mod._GENERATION] = 1
    hdr[ring_mod._VERSION] = ring_mod.LAYOUT_VERSION
    hdr[ring_mod._MAGIC] = ring_mod.RING_MAGIC
    del hdr
    return mem, Ring(mem)


def _record_bytes(arrays: dict) -> bytes:
    mem, writer = _fresh()
    writer.write(arrays)
    total = int(np.ndarray((HEADER_SIZE // 8,), _U64, buffer=mem.buf)[ring_mod._HEAD])
    return bytes(mem.buf[HEADER_SIZE:HEADER_SIZE + total])


SEEDS = [_record_bytes(a) for a in (
    build_job(JobKind.PREFILL, [Lane([1, 2, 3], 0, [0]), None, Lane([4], 7, [1, 2])]).to_arrays(),
    JobResult(1, 1, JobKind.DECODE, JobStatus.OK, np.array([3, 4], np.int32), np.zeros(2, np.float32),
              logits=np.ones((2, 3), np.float32)).to_arrays(),
    {"ctl": np.array([5], np.int64), "empty": np.zeros((0, 4), np.float32), "grid": np.arange(6, dtype=np.uint8)
     .reshape(2, 3)},
)]


def one_input(data: bytes) -> None:
    data = data[:CAPACITY]
    if len(data) < ALIGN:
        return
    mem, _ = _fresh()
    head = len(data) - len(data) % ALIGN
    mem.buf[HEADER_SIZE:HEADER_SIZE + len(data)] = data
    hdr = np.ndarray((HEADER_SIZE // 8,), _U64, buffer=mem.buf)
    hdr[ring_mod._HEAD] = head
    hdr[ring_mod._WRITTEN] = 1
    del hdr
    reader = Ring(mem)
    try:
        rec = reader.peek()
    except RingCorrupt:
        return
    if rec is None:
        raise Finding(f"peek saw no record in a ring with {head} committed bytes | {data[:64]!r}")
    start = ring_mod._REC_HDR.size + ring_mod._REC_HDR.unpack_from(data, 0)[1]
    for name in rec:
        _, dt, shape, off = rec._fields[name]
        nbytes = int(np.prod(shape, dtype=object)) * dt.itemsize
        if nbytes and not (start <= off and off + nbytes <= rec.nbytes):
            raise Finding(f"a returned array lies outside its record | {name!r}: bytes [{off}, {off + nbytes}) "
                          f"of a record of {rec.nbytes} whose descriptor ends at {start}")
        try:
            view = rec[name]
        except Exception as e:
            raise Finding(f"a returned record's array cannot be read: {type(e).__name__} | {name!r}: {e}") from None
        if view.shape != tuple(shape) or view.flags.writeable:
            raise Finding(f"a view of the wrong shape or writable | {name!r} {view.shape} vs {shape}")
    reader.release()
