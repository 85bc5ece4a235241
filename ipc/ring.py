"""A single-producer single-consumer ring of records of named numpy arrays.

Why: tensors between scheduler and worker (tokens, block tables, logits)
must not be serialised. The writer reserves a record, fills writable numpy
views that live in shared memory, and commits; the reader peeks zero-copy
read-only views and releases the record when it is done with them.

Segment layout (all counters are uint64 at 8-byte aligned offsets; the
writer's and the reader's counters sit on separate cache lines):

    0    magic, layout version, capacity, generation, creator pid
    64   head (bytes committed, monotonic), wrap_from, records written  [writer]
    128  tail (bytes released, monotonic), records read                  [reader]
    256  data region of `capacity` bytes (a multiple of 64)

A record is contiguous in the data region and starts 64-byte aligned:

    u32 magic, u32 descriptor length, u64 total length, u64 sequence number,
    descriptor (name, dtype, shape, offset of every array), then the arrays,
    each 64-byte aligned.

When a record does not fit between the head and the end of the data region,
the writer stores the head position in `wrap_from` and places the record at
offset 0 of the next lap; a reader whose tail reaches `wrap_from` jumps to
the next lap. No padding is written into the data region, so a record of up
to `capacity` bytes always fits once the reader has caught up.

The writer also starts a new lap early, the same way, when the head is past
`REWIND_AFTER` bytes into the lap and the reader has caught up. Why: every
page of a shared-memory segment the head has passed over stays resident, so
a mostly empty ring that kept marching through its whole capacity would grow
both processes' RSS by `capacity` bytes (64 MiB per ring in a daemon) before
levelling off, which under steady load looks exactly like a leak.
Rewinding keeps the resident part of a ring near its peak occupancy.

No torn record is ever visible: the writer fills the record, issues a fence
(`ipc.fence`) and only then stores the new head, a single aligned 8-byte
store. A writer killed before that store leaves the head where it was, so a
reader (or a reader attaching later) sees only fully committed records. The
reader checks each record's magic, sequence number, length and descriptor
(arrays of plain dtypes inside the record) anyway, so memory that is not a
committed record raises `RingCorrupt` rather than being returned.

The generation counter is bumped by `reset()`; a peer that notices a new
generation raises `RingReset` once and resynchronises.
"""

from __future__ import annotations

import functools
import math
import struct
import time
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any

import numpy as np

from ipc.fence import fence
from ipc.shm import Segment

ALIGN = 64
HEADER_SIZE = 256
RING_MAGIC = 0x31474E4952555043  # b"CPURING1" little-endian
LAYOUT_VERSION = 1
RECORD_MAGIC = 0x4452434E  # b"NCRD"
_NO_WRAP = 2**64 - 1

# uint64 slots of the segment header
_MAGIC, _VERSION, _CAPACITY, _GENERATION, _CREATOR = 0, 1, 2, 3, 4
_HEAD, _WRAP_FROM, _WRITTEN = 8, 9, 10
_TAIL, _READ = 16, 17

_REC_HDR = struct.Struct("<IIQQ")  # magic, descriptor length, total length, seq
_ARR_HDR = struct.Struct("<HHBxxxQ")  # name length, dtype length, ndim, offset in record
# Record shapes whose layout each side of a ring keeps (an LRU per side). A decode step's shape repeats;
# a prompt chunk's often is new, so the cache holds the repeating ones and sees the rest go. An entry
# costs ~2 KB (the spec's items, the fields, the descriptor): 128 of them ~0.25 MB per ring side, few
# enough that a slow real model fills them within its first hundred or so requests, so the cache's
# warm-up is over before a soak's leak fit begins.
DEFAULT_LAYOUT_CACHE_ENTRIES = 128
REWIND_AFTER = 1 << 20  # bytes into a lap past which an empty ring restarts at offset 0 (at most capacity/2)

Spec = Mapping[str, tuple[tuple[int, ...], "np.dtype[Any] | str"]]


class RingFull(TimeoutError):
    """The writer could not get space within its timeout (back-pressure)."""


class RecordTooLarge(ValueError):
    """The record can never fit in this ring, however empty it gets."""


class RingCorrupt(RuntimeError):
    """The data region holds something that is not the expected committed record."""


class RingReset(RuntimeError):
    """The ring was re-initialised (its generation changed); in-flight records are gone."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class _Layout:
    """Where each array of one record shape lives; cached per distinct spec."""

    __slots__ = ("fields", "descriptor", "total")

    def __init__(self, fields: list[tuple[str, np.dtype[Any], tuple[int, ...], int]], descriptor: bytes, total: int):
        self.fields = fields  # (name, dtype, shape, offset from record start)
        self.descriptor = descriptor
        self.total = total


def _check_dtype(name: str, dt: np.dtype[Any]) -> None:
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
        raise TypeError(f"array {name!r}: dtype {dt} cannot live in shared memory")


def _build_layout(spec_items: tuple) -> _Layout:
    """The layout of a record whose spec has these `(name, (shape, dtype))` items, in order."""
    items: list[tuple[str, np.dtype[Any], tuple[int, ...], bytes, bytes]] = []
    desc_len = 0
    for name, (shape, dtype) in spec_items:
        dt = np.dtype(dtype)
        _check_dtype(name, dt)
        shp = tuple(int(d) for d in shape)
        if any(d < 0 for d in shp):
            raise ValueError(f"array {name!r}: negative dimension in {shp}")
        nb, db = name.encode(), dt.str.encode()
        if len(nb) > 0xFFFF or len(shp) > 64:
            raise ValueError(f"array {name!r}: name or rank too large")
        items.append((name, dt, shp, nb, db))
        desc_len += _ARR_HDR.size + 8 * len(shp) + len(nb) + len(db)
    offset = _align(_REC_HDR.size + desc_len)
    fields = []
    parts = []
    for name, dt, shp, nb, db in items:
        parts.append(_ARR_HDR.pack(len(nb), len(db), len(shp), offset))
        parts.append(struct.pack(f"<{len(shp)}Q", *shp))
        parts.append(nb)
        parts.append(db)
        fields.append((name, dt, shp, offset))
        offset = _align(offset + int(np.prod(shp, dtype=np.int64)) * dt.itemsize)
    return _Layout(fields, b"".join(parts), max(offset, ALIGN))


_Field = tuple[str, np.dtype[Any], tuple[int, ...], int]  # name, dtype, shape, offset in the record


def _parse_descriptor(desc: bytes) -> tuple[dict[str, _Field], int]:
    """The fields a record descriptor names, and the record length they need (the end of the last array).

    The arrays may begin after the record header and the descriptor. Raises ValueError
    for a descriptor no writer made: cut short, not UTF-8, a dtype that cannot live in shared memory, an
    array over the header or the descriptor."""
    fields = {}
    start = _REC_HDR.size + len(desc)
    end = start
    i = 0
    try:
        while i < len(desc):
            nlen, dlen, ndim, offset = _ARR_HDR.unpack_from(desc, i)
            i += _ARR_HDR.size
            if ndim > 64:  # numpy's limit; the writer refuses more
                raise ValueError(f"rank {ndim}")
            shape = struct.unpack_from(f"<{ndim}Q", desc, i)
            i += 8 * ndim
            if i + nlen + dlen > len(desc):
                raise ValueError("a name or dtype runs past the descriptor")
            name = desc[i : i + nlen].decode()
            i += nlen
            dt = np.dtype(desc[i : i + dlen].decode())
            i += dlen
            _check_dtype(name, dt)
            if math.prod(d for d in shape if d) * max(dt.itemsize, 1) >= 1 << 62:  # numpy: "array is too big"
                raise ValueError(f"array {name!r}: shape {shape} too large")
            nbytes = math.prod(shape) * dt.itemsize
            if nbytes and offset < start:
                raise ValueError(f"array {name!r} overlaps the record header or descriptor")
            end = max(end, offset + nbytes)
            fields[name] = (name, dt, tuple(shape), offset)
    except (struct.error, UnicodeDecodeError, TypeError, SyntaxError) as e:  # np.dtype of garbage: TypeError, ...
        raise ValueError(f"{type(e).__name__}: {e}") from None
    return fields, end


class RecordWriter:
    """A reserved, not yet committed record: fill `arrays`, then commit().

    As a context manager it commits on success and aborts on exception.
    """

    def __init__(self, ring: "Ring", arrays: dict[str, np.ndarray], start: int, new_head: int, wrap_from: int | None):
        self.arrays = arrays
        self._ring = ring
        self._start = start
        self._new_head = new_head
        self._wrap_from = wrap_from
        self._done = False

    def commit(self) -> None:
        if self._done:
            raise RuntimeError("record already committed or aborted")
        self._done = True
        self.arrays = {}
        self._ring._commit(self)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self.arrays = {}
        self._ring._abort(self)

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            if not self._done:
                self.commit()
        else:
            self.abort()


class Record(Mapping[str, np.ndarray]):
    """A committed record: name -> zero-copy read-only numpy view into the ring.

    The views are valid until the ring's release(); after it the Record refuses
    access, but views already taken point at memory the writer may reuse.
    """

    def __init__(self, ro: memoryview, base: int, fields: dict[str, tuple[str, np.dtype[Any], tuple[int, ...], int]],
                 seq: int, nbytes: int):
        self._ro: memoryview | None = ro
        self._base = base
        self._fields = fields  # name -> field, shared by every record of one layout (never modified)
        self._views: dict[str, np.ndarray] = {}
        self.seq = seq
        self.nbytes = nbytes

    def __getitem__(self, key: str) -> np.ndarray:
        v = self._views.get(key)
        if v is not None:
            return v
        if self._ro is None:
            raise RuntimeError("record was released; its views are no longer valid")
        _, dt, shape, off = self._fields[key]
        count = math.prod(shape)
        if count:
            # frombuffer keeps the read-only memoryview as base, so the view can never be made writable
            v = np.frombuffer(self._ro, dt, count, self._base + off).reshape(shape)
        else:
            v = np.empty(shape, dt)
            v.flags.writeable = False
        self._views[key] = v
        return v

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __contains__(self, key: object) -> bool:
        return key in self._fields

    @property
    def released(self) -> bool:
        return self._ro is None

    def _invalidate(self) -> None:
        self._ro = None
        self._views = {}


class Ring:
    """SPSC ring in one shared-memory segment. One process writes, one reads.

    A Ring made by create() owns the segment: as a context manager it unlinks
    it on exit. close() and unlink() are explicit and idempotent.
    """

    name: str
    capacity: int

    def __init__(self, seg: Segment, layout_cache_entries: int = DEFAULT_LAYOUT_CACHE_ENTRIES) -> None:
        self._seg = seg
        self.name = seg.name
        hdr = np.ndarray((HEADER_SIZE // 8,), np.uint64, buffer=seg.buf, offset=0)
        if int(hdr[_MAGIC]) != RING_MAGIC or int(hdr[_VERSION]) != LAYOUT_VERSION:
            raise ValueError(f"{seg.name} is not an npuserve ring (layout {LAYOUT_VERSION})")
        self.capacity = int(hdr[_CAPACITY])
        if HEADER_SIZE + self.capacity > seg.size or self.capacity % ALIGN:
            raise ValueError(f"{seg.name}: capacity {self.capacity} does not match segment size {seg.size}")
        self._hdr: np.ndarray | None = hdr
        self._data: memoryview | None = seg.buf[HEADER_SIZE : HEADER_SIZE + self.capacity]
        self._ro: memoryview | None = self._data.toreadonly()
        n = max(1, int(layout_cache_entries))
        self._layout_of = functools.lru_cache(maxsize=n)(_build_layout)  # spec items -> _Layout
        # descriptor bytes -> (fields by name, the record length they need)
        self._fields_of = functools.lru_cache(maxsize=n)(_parse_descriptor)
        self._pending: RecordWriter | None = None
        self._peeked: Record | None = None
        self._peeked_end = 0
        self._rewind_at = min(REWIND_AFTER, self.capacity // 2)
        self._sync()

    def _sync(self) -> None:
        """(Re)load this side's cached view of the counters from the segment."""
        h = self._h
        self._generation = int(h[_GENERATION])
        self._head = int(h[_HEAD])  # writer's own counter / reader's last seen head
        self._written = int(h[_WRITTEN])
        self._tail = int(h[_TAIL])  # reader's own counter / writer's last seen tail
        self._read = int(h[_READ])
        self._wrap_from = int(h[_WRAP_FROM])

    @property
    def _h(self) -> np.ndarray:
        if self._hdr is None:
            raise ValueError(f"ring {self.name} is closed")
        return self._hdr

    # ---- lifecycle -------------------------------------------------------

    @classmethod
    def create(cls, prefix: str, board: str | int, capacity: int, tag: str = "", *, prefault: bool = False,
               layout_cache_entries: int = DEFAULT_LAYOUT_CACHE_ENTRIES) -> "Ring":
        """prefault: touch every page now, so the first lap of writes does not
        pay page faults (worth it for long-lived rings on the hot path).
        layout_cache_entries: record shapes this side keeps the layout of (see layout_cache_stats)."""
        if capacity < ALIGN:
            raise ValueError(f"ring capacity must be at least {ALIGN} bytes")
        cap = _align(capacity)
        seg = Segment.create(prefix, board, HEADER_SIZE + cap, tag)
        try:
            hdr = np.ndarray((HEADER_SIZE // 8,), np.uint64, buffer=seg.buf, offset=0)
            hdr[:] = 0
            hdr[_WRAP_FROM] = _NO_WRAP
            hdr[_CAPACITY] = cap
            hdr[_GENERATION] = 1
            hdr[_CREATOR] = seg.owner_pid
            hdr[_VERSION] = LAYOUT_VERSION
            if prefault:
                np.frombuffer(seg.buf, np.uint8, cap, HEADER_SIZE)[:] = 0
            fence()
            hdr[_MAGIC] = RING_MAGIC  # last: an attacher never sees a half-initialised header
            del hdr
            return cls(seg, layout_cache_entries)
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach(cls, name: str, layout_cache_entries: int = DEFAULT_LAYOUT_CACHE_ENTRIES) -> "Ring":
        seg = Segment.attach(name)
        try:
            return cls(seg, layout_cache_entries)
        except BaseException:
            seg.close()
            raise

    @property
    def generation(self) -> int:
        return int(self._h[_GENERATION])

    @property
    def owner_pid(self) -> int:
        return self._seg.owner_pid

    def reset(self) -> None:
        """Discard every record and bump the generation. Only safe while the
        peer is gone or idle (e.g. the owner re-initialising for a restarted
        worker); the peer raises RingReset once when it next touches the ring."""
        if self._pending is not None:
            self._pending.abort()
        if self._peeked is not None:
            self._peeked._invalidate()
            self._peeked = None
        h = self._h
        h[_HEAD] = 0
        h[_TAIL] = 0
        h[_WRITTEN] = 0
        h[_READ] = 0
        h[_WRAP_FROM] = _NO_WRAP
        fence()
        h[_GENERATION] = int(h[_GENERATION]) + 1
        self._sync()

    def _check_generation(self) -> None:
        gen = int(self._h[_GENERATION])
        if gen != self._generation:
            fence()
            if self._peeked is not None:
                self._peeked._invalidate()
                self._peeked = None
            self._pending = None
            old = self._generation
            self._sync()
            raise RingReset(f"ring {self.name} was reset (generation {old} -> {gen})")

    def close(self) -> None:
        if self._hdr is None:
            return
        if self._pending is not None:
            self._pending.abort()
        if self._peeked is not None:
            self._peeked._invalidate()
            self._peeked = None
        self._hdr = None
        for mv in (self._ro, self._data):
            if mv is not None:
                try:
                    mv.release()
                except BufferError:
                    pass
        self._ro = self._data = None
        self._seg.close()

    def unlink(self) -> None:
        self._seg.unlink()

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.close()
        finally:
            if self._seg.created:
                self.unlink()

    def __repr__(self) -> str:
        return f"Ring({self.name!r}, capacity={self.capacity})"

    # ---- writer side -----------------------------------------------------

    def _layout(self, spec: Spec) -> _Layout:
        # np.dtype and str both hash cheaply; the key is only a cache key. Shapes are usually tuples already
        # (the spec is then its own key, made once per record without a generator); a list shape is not
        # hashable and takes the long way.
        try:
            return self._layout_of(tuple(spec.items()))
        except TypeError:
            return self._layout_of(tuple((k, (s if type(s) is tuple else tuple(s), d)) for k, (s, d) in spec.items()))

    def layout_cache_stats(self, side: str) -> dict:
        """The cache of record layouts this object keeps as the ring's writer (`side` "write") or reader
        ("read"): entries, max_entries, hits, misses."""
        i = {"write": self._layout_of, "read": self._fields_of}[side].cache_info()
        return {"entries": i.currsize, "max_entries": i.maxsize, "hits": i.hits, "misses": i.misses}

    def record_size(self, spec: Spec) -> int:
        """Bytes a record of this spec occupies in the ring (header included)."""
        return self._layout(spec).total

    def _place(self, total: int) -> tuple[int, int | None] | None:
        """Where a record of `total` bytes can start now, or None when the ring is too full."""
        cap = self.capacity
        head = self._head
        pos = head % cap
        wrap = cap - pos < total
        if not wrap and pos >= self._rewind_at:
            if self._tail != head:
                self._tail = int(self._h[_TAIL])
                fence()  # our payload stores must not overtake the tail load
            wrap = self._tail == head  # the reader caught up: restart the lap, touch no new pages
        start = head - pos + cap if wrap else head

        def fits(tail: int) -> bool:
            if tail == head:
                return True  # the reader has caught up: the whole region is free
            if tail == self._wrap_from:
                tail += cap - tail % cap  # nothing but the skipped lap end lies ahead of it
            return start + total - tail <= cap

        if not fits(self._tail):
            self._tail = int(self._h[_TAIL])
            if not fits(self._tail):
                return None
            fence()  # our payload stores must not overtake the tail load
        return start, (head if wrap else None)

    def reserve(self, spec: Spec, timeout: float | None = 0.0) -> RecordWriter:
        """Reserve space for one record; fill `.arrays` then commit().

        timeout: 0 fails at once when full, None waits for ever, else seconds.
        Raises RingFull (back-pressure) or RecordTooLarge.
        """
        if self._pending is not None:
            raise RuntimeError("a reserved record is still pending; commit or abort it first")
        self._check_generation()
        lay = self._layout(spec)
        total = lay.total
        if total > self.capacity:
            raise RecordTooLarge(f"record of {total} bytes can never fit in ring {self.name} of {self.capacity} bytes")
        placed = self._place(total)
        if placed is None:
            placed = self._wait_for_space(total, timeout)
        start, wrap_from = placed
        data = self._data
        assert data is not None
        base = start % self.capacity
        _REC_HDR.pack_into(data, base, RECORD_MAGIC, len(lay.descriptor), total, self._written)
        d0 = base + _REC_HDR.size
        data[d0 : d0 + len(lay.descriptor)] = lay.descriptor
        arrays = {
            name: np.ndarray(shape, dt, buffer=data, offset=base + off) for name, dt, shape, off in lay.fields
        }
        w = RecordWriter(self, arrays, start, start + total, wrap_from)
        self._pending = w
        return w

    def _wait_for_space(self, total: int, timeout: float | None) -> tuple[int, int | None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        nap = 20e-6
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                raise RingFull(
                    f"ring {self.name}: no room for {total} bytes within {timeout}s "
                    f"({min(self._head - self._tail, self.capacity)} of {self.capacity} bytes in use)"
                )
            time.sleep(nap if deadline is None else max(0.0, min(nap, deadline - time.monotonic())))
            nap = min(nap * 2, 1e-3)
            self._check_generation()
            placed = self._place(total)
            if placed is not None:
                return placed

    def _commit(self, w: RecordWriter) -> None:
        assert self._pending is w
        self._pending = None
        h = self._h
        if w._wrap_from is not None:
            h[_WRAP_FROM] = w._wrap_from
            self._wrap_from = w._wrap_from
        # The record count goes out before the head: once the head is visible
        # the reader may consume the record and bump READ, and a WRITTEN that
        # lagged behind would make len() negative.
        self._written += 1
        h[_WRITTEN] = self._written
        fence()  # payload, wrap_from and the count before the head
        h[_HEAD] = w._new_head  # the commit: one aligned 8-byte store
        self._head = w._new_head

    def _abort(self, w: RecordWriter) -> None:
        if self._pending is w:
            self._pending = None

    def write(self, arrays: Mapping[str, np.ndarray], timeout: float | None = 0.0) -> None:
        """Reserve, copy `arrays` in and commit."""
        spec = {k: (a.shape, a.dtype) for k, a in arrays.items()}
        with self.reserve(spec, timeout) as w:
            for k, a in arrays.items():
                np.copyto(w.arrays[k], a, casting="no")

    # ---- reader side -----------------------------------------------------

    def peek(self) -> Record | None:
        """The next committed record (zero-copy, read-only), or None when empty.

        Peeking again before release() returns the same record.
        """
        if self._peeked is not None:
            return self._peeked
        self._check_generation()
        h = self._h
        if self._tail == self._head:
            self._head = int(h[_HEAD])
            if self._tail == self._head:
                return None
        fence()  # the head load before any payload load
        cap = self.capacity
        if self._tail == int(h[_WRAP_FROM]):
            self._tail += cap - self._tail % cap
            h[_TAIL] = self._tail
        pos = self._tail % cap
        ro = self._ro
        assert ro is not None
        magic, dlen, total, seq = _REC_HDR.unpack_from(ro, pos)
        avail = self._head - self._tail
        if magic != RECORD_MAGIC or seq != self._read or not (ALIGN <= total <= min(avail, cap - pos)) or total % ALIGN:
            raise RingCorrupt(
                f"ring {self.name}: no valid record at tail {self._tail} "
                f"(magic {magic:#x}, seq {seq} expected {self._read}, length {total}, {avail} committed)"
            )
        d0 = pos + _REC_HDR.size
        if _REC_HDR.size + dlen > total:
            raise RingCorrupt(f"ring {self.name}: the record at tail {self._tail} is {total} bytes, its "
                              f"descriptor alone {dlen}")
        desc = bytes(ro[d0 : d0 + dlen])
        try:
            fields, need = self._fields_of(desc)
        except ValueError as e:
            raise RingCorrupt(f"ring {self.name}: bad record descriptor at tail {self._tail}: {e}") from None
        if need > total:
            raise RingCorrupt(f"ring {self.name}: the record at tail {self._tail} is {total} bytes, its "
                              f"arrays need {need}")
        rec = Record(ro, pos, fields, seq, total)
        self._peeked = rec
        self._peeked_end = self._tail + total
        return rec

    def release(self) -> None:
        """Free the peeked record; its views must not be used afterwards."""
        rec = self._peeked
        if rec is None:
            raise RuntimeError("release() without a peeked record")
        rec._invalidate()
        self._peeked = None
        fence()  # finish reading the payload before the writer may reuse it
        self._tail = self._peeked_end
        h = self._h
        h[_TAIL] = self._tail
        self._read += 1
        h[_READ] = self._read

    def read(self) -> dict[str, np.ndarray] | None:
        """Copy the next record out and release it; None when empty."""
        rec = self.peek()
        if rec is None:
            return None
        out = {k: np.array(v) for k, v in rec.items()}
        self.release()
        return out

    def __len__(self) -> int:
        """Committed, unreleased records; never negative, and may already
        count a record whose commit is in progress (its head store pending)."""
        h = self._h
        return int(h[_WRITTEN]) - int(h[_READ])
