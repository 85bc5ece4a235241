"""Regression tests for what fuzzing the ipc decoders found (tools/fuzz; docs/fuzzing.md), each with
the smallest input that showed it.

* ring records: a descriptor that is not what a writer makes (not UTF-8, an unknown or object dtype,
  cut short, arrays over the record header or past the record's end) raised struct.error,
  UnicodeDecodeError, TypeError or ValueError from `peek` or from reading a field, or handed out views
  of bytes outside the record; it is `RingCorrupt` now, as the ring's contract says.
* job records: a meta shorter than a job's raised IndexError, and so did a result meta shorter than its
  eight slots once `JobResult.from_arrays` read them by index (found on merging main); a negative size in the meta gave fields
  sliced from the wrong end of the blob; both are the documented ValueError now.
* the wire: a hand-off `curve_key` of 40 characters outside z85 was accepted, and zmq then refused it
  outside any handler when the decode board connected (docs/protocol.md says z85).
"""

from __future__ import annotations

import os
import struct

import numpy as np
import posix_ipc
import pytest

from ipc.codec import ProtocolError, decode_request, encode
from ipc.records import Job, JobKind, JobResult, JobStatus, Lane, build_job
from ipc.ring import Ring, RingCorrupt
from ipc.shm import list_segments

PREFIX = f"nptfuzz{os.getpid()}"

# One record of {"a": int32[4]} at data offset 0: header <IIQQ (24 bytes), then the descriptor of "a":
# <HHBxxxQ (name length, dtype length, ndim, offset) at 24, its shape at 40, "a" at 48, "<i4" at 49.
_DLEN, _NDIM, _OFFSET, _SHAPE, _NAME, _DTYPE = 4, 28, 32, 40, 48, 49


@pytest.fixture
def ring():
    r = Ring.create(PREFIX, 0, 4096, "f")
    r.write({"a": np.arange(4, dtype=np.int32)})
    r.write({"a": np.full(4, 7, np.int32)})  # the record after it, whose bytes the first must not expose
    yield r
    r.close()
    r.unlink()
    for name in list_segments(PREFIX):
        posix_ipc.unlink_shared_memory(name)


def _peek_all(ring: Ring) -> None:
    rec = ring.peek()
    for name in rec:
        rec[name]


def test_the_fixture_record_reads_back(ring):
    rec = ring.peek()
    assert list(rec) == ["a"] and rec["a"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("at, raw", [
    pytest.param(_NAME, b"\xa0", id="name-not-utf8"),
    pytest.param(_DTYPE, b"<z4", id="dtype-unknown"),
    pytest.param(_DTYPE, b"4 \0", id="dtype-unparsable"),
    pytest.param(_DTYPE, b"|O8", id="dtype-object"),
    pytest.param(_NDIM, b"\x03", id="shape-past-descriptor"),
    pytest.param(_NDIM, b"\x4a", id="rank-over-numpy"),
    pytest.param(_DLEN, struct.pack("<I", 4000), id="descriptor-past-record"),
    pytest.param(_SHAPE, struct.pack("<Q", 1 << 40), id="array-past-ring"),
    pytest.param(_SHAPE, struct.pack("<Q", 40), id="array-into-next-record"),
    pytest.param(_OFFSET, struct.pack("<Q", 128), id="array-in-next-record"),
    pytest.param(_OFFSET, struct.pack("<Q", 0), id="array-over-header"),
])
def test_a_record_descriptor_no_writer_made_is_ringcorrupt(ring, at, raw):
    ring._data[at:at + len(raw)] = raw
    with pytest.raises(RingCorrupt):
        _peek_all(ring)


def _job_arrays() -> dict:
    return build_job(JobKind.PREFILL, [Lane([1, 2, 3], 0, [0])]).to_arrays()


def test_a_job_meta_one_entry_short_is_valueerror():
    a = _job_arrays()
    a["meta"] = a["meta"][:26]
    with pytest.raises(ValueError):
        Job.from_arrays(a)


def test_a_negative_size_in_a_job_meta_is_valueerror():
    a = _job_arrays()
    a["meta"] = a["meta"].copy()
    a["meta"][4], a["meta"][5] = -1, a["meta"][4] + a["meta"][5] + 1  # tokens -1, positions 1 more: sums agree
    with pytest.raises(ValueError):
        Job.from_arrays(a)


@pytest.mark.parametrize("n", [0, 7])
def test_a_result_meta_too_short_for_its_slots_is_valueerror(n):
    a = JobResult(1, 1, JobKind.DECODE, JobStatus.OK, np.array([3], np.int32), np.zeros(1, np.float32)).to_arrays()
    a["meta"] = a["meta"][:n]
    with pytest.raises(ValueError):
        JobResult.from_arrays(a)


def test_a_result_meta_of_an_older_worker_still_reads():
    a = JobResult(1, 1, JobKind.DECODE, JobStatus.OK, np.array([3], np.int32), np.zeros(1, np.float32),
                  masks=2, mask_us=5).to_arrays()
    a["meta"] = a["meta"][:8]  # no device_start_ns, idle_us
    r = JobResult.from_arrays(a)
    assert (r.masks, r.mask_us, r.device_start_ns, r.idle_us) == (2, 5, 0, -1)


def _handoff(key: str) -> bytes:
    return encode({"v": 1, "op": "generate", "id": "r", "prompt": [1],
                   "handoff": {"board": "b", "request": "h", "endpoint": "tcp://127.0.0.1:9", "curve_key": key}})


def test_a_hand_off_curve_key_outside_z85_is_refused():
    with pytest.raises(ProtocolError) as e:
        decode_request(_handoff(" " * 40))
    assert e.value.reason == "out_of_range" and "curve_key" in e.value.message


def test_a_z85_hand_off_curve_key_is_accepted():
    key = "UM!@%]L=?l+Uv#ZO89.hmX6L9<c1-Zg5uo>3ze}]"  # zmq.curve_keypair()'s form
    assert decode_request(_handoff(key))["handoff"]["curve_key"] == key
