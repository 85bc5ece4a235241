"""The ring between real processes: bulk transfer with checksums, and a writer
SIGKILLed mid-write (no torn record visible, reap_stale cleans /dev/shm).

The child processes run this file as a script (see the bottom), so their code
is plain functions here rather than strings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from ipc.doorbell import SemaphoreDoorbell
from ipc.ring import Ring, RingFull
from ipc.shm import list_segments, list_semaphores, reap_stale

PREFIX = f"nptxp{os.getpid()}"
pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def cleanup():
    """Whatever happens, no object of this test outlives it."""
    yield
    reap_stale(PREFIX)  # children are dead by now; anything of ours left was theirs
    assert _ours() == set()


def _payload(seed: int, i: int) -> np.ndarray:
    """Record i's payload, reproducible from (seed, i) in any process: mostly
    small, sometimes large, so that the ring wraps and applies back-pressure."""
    rng = np.random.default_rng((seed, i))
    n = int(rng.integers(60_000, 120_000)) if rng.random() < 0.05 else int(rng.integers(0, 3000))
    return rng.integers(0, 256, size=n, dtype=np.uint8)


def _write_one(ring: Ring, seed: int, i: int, timeout: float | None) -> None:
    data = _payload(seed, i)
    with ring.reserve({"meta": ((3,), np.int64), "payload": (data.shape, np.uint8)}, timeout=timeout) as w:
        w.arrays["payload"][:] = data
        w.arrays["meta"][:] = (i, zlib.crc32(data), data.size)


def _check_record(rec, expect_seq: int) -> int:
    """Verify one record against its own checksum; return its crc."""
    seq, crc, n = (int(x) for x in rec["meta"])
    assert seq == expect_seq, f"record {seq} arrived, expected {expect_seq}"
    payload = rec["payload"]
    assert payload.size == n
    assert zlib.crc32(payload) == crc, f"record {seq} is torn or corrupt"
    return crc


# ---- child processes -------------------------------------------------------------


def child_writer(ring_name: str, bell_name: str, seed: int, count: int) -> None:
    ring = Ring.attach(ring_name)
    bell = SemaphoreDoorbell.attach(bell_name)
    for i in range(count):
        _write_one(ring, seed, i, timeout=30.0)
        bell.ring()
    ring.close()
    bell.close()


def child_reader(ring_name: str, bell_name: str, count: int) -> None:
    ring = Ring.attach(ring_name)
    bell = SemaphoreDoorbell.attach(bell_name)
    total = 0
    i = 0
    deadline = time.monotonic() + 60
    while i < count:
        rec = ring.peek()
        if rec is None:
            assert time.monotonic() < deadline, f"reader stalled after {i} records"
            bell.wait(0.1)
            continue
        total = (total + _check_record(rec, i)) % 2**64
        ring.release()
        i += 1
    print(f"{i} {total}", flush=True)
    ring.close()
    bell.close()


def child_dying_writer(prefix: str, seed: int, committed: int, mode: str) -> None:
    """Own a ring and a doorbell, write `committed` records, then either stall
    half-way through the next record ("mid") or keep writing ("stream")
    until killed."""
    ring = Ring.create(prefix, 0, 1 << 18, "dying")
    bell = SemaphoreDoorbell.create(prefix, 0, "dying")
    print(ring.name, bell.name, flush=True)
    for i in range(committed):
        _write_one(ring, seed, i, timeout=None)
        bell.ring()
    if mode == "mid":
        w = ring.reserve({"meta": ((3,), np.int64), "payload": ((100_000,), np.uint8)}, timeout=None)
        w.arrays["meta"][:] = (committed, 0, 100_000)
        w.arrays["payload"][:50_000] = 7
        print("mid", flush=True)
        time.sleep(60)
    else:
        print("streaming", flush=True)
        i = committed
        while True:
            try:
                _write_one(ring, seed, i, timeout=0.5)
            except RingFull:
                continue
            bell.ring()
            i += 1


# ---- tests -----------------------------------------------------------------------


def _spawn(*args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *map(str, args)], stdout=subprocess.PIPE, text=True
    )


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout:
        proc.stdout.close()


def _ours() -> set[str]:
    return set(list_segments(PREFIX)) | set(list_semaphores(PREFIX))


def test_writer_and_reader_processes_pass_10000_mixed_records():
    seed, count = 11, 10_000
    expected = 0
    for i in range(count):
        expected = (expected + zlib.crc32(_payload(seed, i))) % 2**64
    with Ring.create(PREFIX, 0, 1 << 18, "bulk") as ring, SemaphoreDoorbell.create(PREFIX, 0, "bulk") as bell:
        reader = _spawn("reader", ring.name, bell.name, count)
        writer = _spawn("writer", ring.name, bell.name, seed, count)
        try:
            assert writer.wait(90) == 0
            out = reader.stdout.readline().split()
            assert reader.wait(30) == 0
        finally:
            _reap(writer)
            _reap(reader)
        assert out == [str(count), str(expected)]
        assert len(ring) == 0
    assert _ours() == set()


def _reader_drains(ring: Ring, seed: int) -> int:
    """Read every visible record, checking content; return how many there were."""
    i = 0
    while (rec := ring.peek()) is not None:
        assert zlib.crc32(rec["payload"]) == zlib.crc32(_payload(seed, i))
        _check_record(rec, i)
        ring.release()
        i += 1
    return i


def test_writer_killed_mid_write_leaves_only_committed_records_and_is_reaped():
    start = _ours()
    seed, committed = 5, 20
    writer = _spawn("dying", PREFIX, seed, committed, "mid")
    try:
        ring_name, bell_name = writer.stdout.readline().split()
        assert writer.stdout.readline().strip() == "mid"
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(10) == -signal.SIGKILL
    finally:
        _reap(writer)
    assert _ours() == start | {ring_name, bell_name}  # the dead writer's objects are left behind
    with Ring.attach(ring_name) as ring:  # a reader attaching after the writer died
        assert len(ring) == committed
        assert _reader_drains(ring, seed) == committed  # the half-written record is invisible
        assert ring.peek() is None
    assert sorted(reap_stale(PREFIX)) == sorted([ring_name, bell_name])
    assert _ours() == start


def test_writer_killed_while_streaming_never_exposes_a_torn_record():
    start = _ours()
    seed = 9
    writer = _spawn("dying", PREFIX, seed, 0, "stream")
    try:
        ring_name, bell_name = writer.stdout.readline().split()
        assert writer.stdout.readline().strip() == "streaming"
        ring = Ring.attach(ring_name)
        bell = SemaphoreDoorbell.attach(bell_name)
        seen = 0
        while seen < 200:  # consume concurrently so the writer keeps copying, then kill it mid-stream
            rec = ring.peek()
            if rec is None:
                bell.wait(0.05)
                continue
            _check_record(rec, seen)
            ring.release()
            seen += 1
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(10) == -signal.SIGKILL
    finally:
        _reap(writer)
    while (rec := ring.peek()) is not None:
        _check_record(rec, seen)
        ring.release()
        seen += 1
    assert seen > 0
    ring.close()
    bell.close()
    assert sorted(reap_stale(PREFIX)) == sorted([ring_name, bell_name])
    assert _ours() == start


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    if role == "writer":
        child_writer(rest[0], rest[1], int(rest[2]), int(rest[3]))
    elif role == "reader":
        child_reader(rest[0], rest[1], int(rest[2]))
    elif role == "dying":
        child_dying_writer(rest[0], int(rest[1]), int(rest[2]), rest[3])
    else:
        raise SystemExit(f"unknown role {role}")
