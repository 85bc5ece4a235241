"""Giving free heap memory back now and then (`board.malloc_trim_interval_s`): a collection, then `malloc_trim`.

glibc keeps the memory a process frees for its next allocations instead of
returning it; a daemon serving a real model allocates and frees buffers of
many sizes (job encodings of many shapes, token lists, text), so free chunks
scattered through its heap stay resident and its RSS creeps up while the
memory in use is flat (docs/results/2026-12-05-llamacpp-soak-memory.md).
`malloc_trim(0)` returns every whole free page of every arena. It walks the
heap (milliseconds to tens of milliseconds, more on a fragmented heap and a
loaded machine; `last_trim_ms` says), so it runs at most once per interval,
from the daemon's supervise tick, never per request.

Before it, a full garbage collection: besides cycles, it empties CPython's
free lists, which keep freed objects for reuse by type and size and are
emptied by nothing else. The tuple lists alone keep up to 2,000 tuples of
each length 1-20 (~5 MB when full); they fill to the largest burst of tuples
of each length freed at once, which a slow real model reaches only over
hours (a Gemma soak: ~3 KB a request for its whole 25 minutes, 1.25 MB of
freed tuples by the end). Emptied every interval, they hold at most one
interval's bursts. Its time is `last_collect_ms` (tens of ms on the
daemon's heap).

glibc only: elsewhere (musl, macOS) there is no `malloc_trim` and the
trimmer reports itself unavailable and does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable

from workers.heap_snapshots import anon_rss


def _glibc_trim() -> Callable[[], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    fn = getattr(libc, "malloc_trim", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: int(fn(0))


class HeapTrimmer:
    """Runs a full collection and `malloc_trim(0)` at most every `interval_s` (0 = never) and counts what
    they gave back.

    `trim`, `collect` and `rss` are injectable so the schedule and the accounting are tested without glibc.
    """

    def __init__(self, interval_s: float, start: float, trim: Callable[[], int] | None | str = "glibc",
                 rss: Callable[[], int] = anon_rss, timer: Callable[[], float] = time.perf_counter,
                 collect: Callable[[], int] = gc.collect) -> None:
        self.interval_s = interval_s
        self._trim = _glibc_trim() if trim == "glibc" else trim
        self._collect = collect
        self._rss = rss
        self._timer = timer
        self.next_at = start + interval_s
        self.trims = 0
        self.released_bytes = 0  # anonymous RSS given back, summed over the trims
        self.last_released_bytes = 0
        self.last_trim_ms = 0.0  # how long the last malloc_trim held the loop
        self.last_collect_ms = 0.0  # how long the full collection before it held the loop

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0 and self._trim is not None

    def maybe_trim(self, now: float) -> int | None:
        """Trim if the interval has passed; returns the RSS it gave back (bytes), None when it did not run."""
        if not self.enabled or now < self.next_at:
            return None
        self.next_at = now + self.interval_s
        before = self._rss()
        t0 = self._timer()
        self._collect()
        t1 = self._timer()
        self._trim()
        self.last_collect_ms = (t1 - t0) * 1000.0
        self.last_trim_ms = (self._timer() - t1) * 1000.0
        released = max(0, before - self._rss())
        self.trims += 1
        self.released_bytes += released
        self.last_released_bytes = released
        return released

    def stats(self) -> dict:
        return {"interval_s": self.interval_s, "available": self._trim is not None, "trims": self.trims,
                "released_bytes": self.released_bytes, "last_released_bytes": self.last_released_bytes, "last_trim_ms": round(self.last_trim_ms, 3),
                "last_collect_ms": round(self.last_collect_ms, 3)}
