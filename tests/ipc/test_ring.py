"""The shared-memory ring in one process: API behaviour and a stateful model.

The stateful test drives a writer handle and a separately attached reader
handle (so everything passes through shared memory, not Python state) and
checks them against a deque of committed records plus a physical model of
the data region: records are contiguous byte intervals, placed at the write
position, or at offset 0 when they do not fit before the end, and only where
no unreleased record lies. The ring's counter arithmetic must agree with
that interval model on every success and every RingFull.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import posix_ipc
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ipc.ring import ALIGN, HEADER_SIZE, REWIND_AFTER, RecordTooLarge, Ring, RingCorrupt, RingFull, RingReset
from ipc.shm import list_segments

PREFIX = f"nptring{os.getpid()}"


@pytest.fixture
def ring():
    r = Ring.create(PREFIX, 0, 4096, "t")
    yield r
    r.close()
    r.unlink()


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves a segment behind, and remove it either way."""
    yield
    segs = list_segments(PREFIX)
    for name in segs:
        posix_ipc.unlink_shared_memory(name)
    assert segs == []


def test_roundtrip_preserves_names_dtypes_shapes_and_values(ring):
    arrays = {
        "tokens": np.arange(7, dtype=np.int32),
        "table": np.arange(12, dtype=np.int32).reshape(3, 4) - 5,
        "logits": np.linspace(-1, 1, 10, dtype=np.float32),
        "seed": np.array([2**64 - 1, 3], dtype=np.uint64),
        "mask": np.array([True, False, True]),
        "empty": np.zeros((0, 5), dtype=np.float64),
        "scalar": np.array(3.5, dtype=np.float16),
    }
    ring.write(arrays)
    out = ring.read()
    assert out is not None and list(out) == list(arrays)
    for k, a in arrays.items():
        assert out[k].dtype == a.dtype and out[k].shape == a.shape
        np.testing.assert_array_equal(out[k], a)


def test_peek_views_are_zero_copy_read_only_and_64_byte_aligned(ring):
    ring.write({"a": np.arange(3, dtype=np.int8), "b": np.arange(5, dtype=np.float64)})
    rec = ring.peek()
    assert rec is not None
    for v in rec.values():
        assert v.ctypes.data % ALIGN == 0
        assert not v.flags.writeable
        with pytest.raises(ValueError):
            v.setflags(write=True)
    assert rec["b"].base is not None  # a view, not an owned copy
    assert ring.peek() is rec  # peeking again before release gives the same record
    ring.release()
    with pytest.raises(RuntimeError):
        rec["a"]
    assert ring.peek() is None


def test_reserve_gives_writable_aligned_views_and_context_commits(ring):
    with ring.reserve({"x": ((4, 3), "f4"), "y": ((5,), np.int16)}) as w:
        assert all(a.ctypes.data % ALIGN == 0 and a.flags.writeable for a in w.arrays.values())
        assert ring.peek() is None  # nothing visible before commit
        w.arrays["x"][:] = 2.0
        w.arrays["y"][:] = np.arange(5)
    out = ring.read()
    assert out is not None
    np.testing.assert_array_equal(out["x"], np.full((4, 3), 2.0, np.float32))
    np.testing.assert_array_equal(out["y"], np.arange(5, dtype=np.int16))


def test_reserve_context_aborts_on_exception(ring):
    with pytest.raises(KeyError):
        with ring.reserve({"x": ((4,), "i4")}) as w:
            w.arrays["x"][:] = 1
            raise KeyError("boom")
    assert ring.peek() is None and len(ring) == 0
    ring.write({"z": np.ones(2, np.int8)})  # the aborted space is reused
    out = ring.read()
    assert out is not None and list(out) == ["z"]


def test_only_one_pending_reservation(ring):
    w = ring.reserve({"x": ((1,), "i4")})
    with pytest.raises(RuntimeError):
        ring.reserve({"x": ((1,), "i4")})
    w.abort()


def test_record_larger_than_ring_is_rejected_even_when_empty(ring):
    with pytest.raises(RecordTooLarge):
        ring.write({"x": np.zeros(ring.capacity, np.uint8)})
    with pytest.raises(ValueError):  # RecordTooLarge is a ValueError
        ring.reserve({"x": ((ring.capacity,), "u1")}, timeout=None)


def test_full_ring_raises_ringfull_after_timeout(ring):
    big = {"x": np.zeros(ring.capacity // 2, np.uint8)}
    ring.write(big)
    with pytest.raises(RingFull):
        ring.write(big, timeout=0)
    with pytest.raises(TimeoutError):  # RingFull is a TimeoutError
        ring.write(big, timeout=0.01)
    ring.read()
    ring.write(big, timeout=0)  # space is back once the reader released


def test_wrap_around_keeps_fifo_order_and_content(ring):
    rng = np.random.default_rng(1)
    sent = collections.deque()
    for i in range(300):
        a = rng.integers(0, 255, size=int(rng.integers(0, 1500)), dtype=np.uint8)
        while True:
            try:
                ring.write({"a": a, "i": np.array([i])})
                break
            except RingFull:
                out = ring.read()
                exp = sent.popleft()
                np.testing.assert_array_equal(out["a"], exp[1])
                assert int(out["i"][0]) == exp[0]
        sent.append((i, a))
    while sent:
        exp = sent.popleft()
        out = ring.read()
        assert int(out["i"][0]) == exp[0]
        np.testing.assert_array_equal(out["a"], exp[1])
    assert ring.read() is None


def test_record_of_full_capacity_fits_when_ring_is_empty_mid_lap(ring):
    """A record as large as the ring fits once the reader caught up, wherever the head is."""
    ring.write({"a": np.zeros(100, np.uint8)})
    ring.read()
    size = ring.record_size({"a": ((0,), "u1")})
    n = ring.capacity - size  # make the record exactly `capacity` bytes
    ring.write({"a": np.full(n, 7, np.uint8)})
    assert ring.record_size({"a": ((n,), "u1")}) == ring.capacity
    out = ring.read()
    assert out is not None and out["a"].shape == (n,) and (out["a"] == 7).all()


def test_attached_reader_sees_writer_records_and_len(ring):
    reader = Ring.attach(ring.name)
    try:
        assert reader.capacity == ring.capacity
        for i in range(3):
            ring.write({"i": np.array([i])})
        assert len(reader) == 3
        assert [int(reader.read()["i"][0]) for _ in range(3)] == [0, 1, 2]
        assert len(ring) == 0
    finally:
        reader.close()


class _StoreLog(np.ndarray):
    """A header view that records the order of the writer's counter stores."""

    log: list[int]

    def __setitem__(self, key, value):
        _StoreLog.log.append(key)
        super().__setitem__(key, value)


def test_record_count_is_published_before_the_head(ring):
    """A reader may consume a record as soon as the head moves; if the
    writer's record count were stored after the head, len() on either side
    could see READ ahead of WRITTEN and go negative (seen as a worker crash
    under load)."""
    from ipc import ring as ring_mod

    _StoreLog.log = []
    ring._hdr = ring._hdr.view(_StoreLog)
    ring.write({"x": np.arange(4)})
    log = _StoreLog.log
    assert ring_mod._WRITTEN in log and ring_mod._HEAD in log
    assert log.index(ring_mod._WRITTEN) < log.index(ring_mod._HEAD)
    reader = Ring.attach(ring.name)
    try:
        assert reader.read() is not None
        assert len(reader) == 0 and len(ring) == 0
    finally:
        reader.close()


def test_reset_bumps_generation_and_peer_raises_ringreset_once(ring):
    reader = Ring.attach(ring.name)
    try:
        ring.write({"i": np.array([1])})
        gen = ring.generation
        ring.reset()
        assert ring.generation == gen + 1 and len(ring) == 0
        with pytest.raises(RingReset):
            reader.peek()
        assert reader.peek() is None  # resynchronised
        ring.write({"i": np.array([2])})
        assert int(reader.read()["i"][0]) == 2
    finally:
        reader.close()


def test_garbage_under_the_head_raises_ringcorrupt_not_a_record(ring):
    ring.write({"i": np.arange(4)})
    ring._data[0:8] = b"\xff" * 8  # scribble over the committed record's header
    with pytest.raises(RingCorrupt):
        ring.peek()


def test_attach_rejects_a_segment_that_is_not_a_ring():
    from ipc.shm import Segment

    with Segment.create(PREFIX, 0, HEADER_SIZE + 128, "x") as seg:
        with pytest.raises(ValueError):
            Ring.attach(seg.name)


def test_close_and_unlink_are_idempotent():
    r = Ring.create(PREFIX, 0, 256)
    r.close()
    r.close()
    r.unlink()
    r.unlink()
    with pytest.raises(ValueError):
        r.peek()


def test_context_manager_of_creator_unlinks():
    with Ring.create(PREFIX, 1, 256, "cm") as r:
        assert list_segments(PREFIX) == [r.name]
    assert list_segments(PREFIX) == []


# ---- stateful model ----------------------------------------------------------

DTYPES = ["u1", "i4", "f4", "f8", "u8"]


@st.composite
def specs(draw):
    n = draw(st.integers(1, 3))
    names = draw(st.lists(st.sampled_from(["a", "b", "tokens", "z"]), min_size=n, max_size=n, unique=True))
    return {
        k: (tuple(draw(st.lists(st.integers(0, 12), min_size=0, max_size=2))), draw(st.sampled_from(DTYPES)))
        for k in names
    }


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class RingModel(RuleBasedStateMachine):
    CAPACITY = 1024

    def __init__(self) -> None:
        super().__init__()
        self.w = Ring.create(PREFIX, "m", self.CAPACITY)
        self.r = Ring.attach(self.w.name)
        self.cap = self.w.capacity
        self.model: collections.deque = collections.deque()  # (arrays, interval), committed, unreleased
        self.pos = 0  # physical write position
        self.pending = None  # (writer, arrays, interval)
        self.peeked = None

    def _place(self, size: int) -> tuple[int, int] | None:
        busy = [iv for _, iv in self.model]
        start = self.pos if self.pos + size <= self.cap else 0
        if not busy and self.pos >= min(REWIND_AFTER, self.cap // 2):
            start = 0  # an empty ring restarts its lap early (keeps its resident pages few)
            event("early rewind of an empty ring")
        iv = (start, start + size)
        if any(_overlaps(iv, b) for b in busy):
            return None
        return iv

    @precondition(lambda self: self.pending is None)
    @rule(spec=specs(), seed=st.integers(0, 2**32 - 1))
    def reserve(self, spec, seed):
        size = self.w.record_size(spec)
        assert size % ALIGN == 0 and size >= ALIGN
        if size > self.cap:
            event("record too large")
            with pytest.raises(RecordTooLarge):
                self.w.reserve(spec)
            return
        iv = self._place(size)
        if iv is None:
            event("ring full")
            with pytest.raises(RingFull):
                self.w.reserve(spec, timeout=0)
            return
        if iv[0] == 0 and self.pos != 0:
            event("wrap-around" + (" into an empty ring" if not self.model else ""))
        wr = self.w.reserve(spec, timeout=0)
        rng = np.random.default_rng(seed)
        arrays = {}
        for k, (shape, dt) in spec.items():
            a = (rng.random(shape) * 1000).astype(dt)
            wr.arrays[k][...] = a
            arrays[k] = a
        self.pending = (wr, arrays, iv)

    @precondition(lambda self: self.pending is not None)
    @rule()
    def commit(self):
        wr, arrays, iv = self.pending
        wr.commit()
        self.pending = None
        self.model.append((arrays, iv))
        self.pos = iv[1]
        assert self.w._head % self.cap == self.pos % self.cap, "the record was not placed where the model says"

    @precondition(lambda self: self.pending is not None)
    @rule()
    def abort(self):
        self.pending[0].abort()
        self.pending = None

    @rule()
    def peek(self):
        rec = self.r.peek()
        if not self.model:
            assert rec is None
            return
        assert rec is not None
        arrays, _ = self.model[0]
        assert list(rec) == list(arrays)
        for k, a in arrays.items():
            assert rec[k].dtype == a.dtype and rec[k].shape == a.shape
            np.testing.assert_array_equal(rec[k], a)
        self.peeked = rec

    @precondition(lambda self: self.peeked is not None)
    @rule()
    def release(self):
        self.r.release()
        self.model.popleft()
        self.peeked = None

    @precondition(lambda self: self.peeked is None)
    @rule()
    def read(self):
        out = self.r.read()
        if not self.model:
            assert out is None
            return
        arrays, _ = self.model.popleft()
        assert out is not None and list(out) == list(arrays)
        for k, a in arrays.items():
            np.testing.assert_array_equal(out[k], a)

    @invariant()
    def lengths_agree(self):
        assert len(self.r) == len(self.model) == len(self.w)

    def teardown(self):
        if self.pending is not None:
            self.pending[0].abort()
        self.r.close()
        self.w.close()
        self.w.unlink()


RingModel.TestCase.settings = settings(
    max_examples=80, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRingModel = RingModel.TestCase


def test_prefault_creates_a_usable_zeroed_ring():
    with Ring.create(PREFIX, 0, 1 << 16, "pf", prefault=True) as r:
        assert bytes(r._data[: r.capacity]) == bytes(r.capacity)
        r.write({"a": np.arange(5)})
        np.testing.assert_array_equal(r.read()["a"], np.arange(5))


def test_layout_caches_stay_at_their_bound_and_keep_the_repeating_shape():
    # A decode step's record shape repeats between prompt chunks whose shapes are all new: each end keeps at most
    # `layout_cache_entries` layouts, evicting the least recently used, so the repeating shape is never rebuilt.
    # (A cache that is cleared when full would rebuild it after every 4 new shapes.)
    writer = Ring.create(PREFIX, 0, 1 << 16, "lc", layout_cache_entries=4)
    reader = Ring.attach(writer.name, layout_cache_entries=4)
    try:
        hot = {"tokens": np.arange(16, dtype=np.int32), "lanes": np.ones(16, np.uint8)}
        for n in range(1, 21):
            for arrays in (hot, {"tokens": np.arange(100 + n, dtype=np.int32), "lanes": np.ones(n, np.uint8)}):
                writer.write(arrays)
                got = reader.read()
                assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in arrays.items()}
        for end in (writer.layout_cache_stats("write"), reader.layout_cache_stats("read")):
            assert end == {"entries": 4, "max_entries": 4, "hits": 19, "misses": 21}
    finally:
        reader.close()
        writer.close()
        writer.unlink()
