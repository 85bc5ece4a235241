"""The daemon's collection and malloc_trim schedule and accounting (board.malloc_trim_interval_s), on a fake
clock and heap; and what the real collection empties."""

import re
import sys

from engine.daemon.heap_trim import HeapTrimmer


class FakeHeap:
    """An RSS that a trim lowers by `gives_back` bytes; `log` is the order of collections and trims."""

    def __init__(self, rss: int, gives_back: int) -> None:
        self.rss, self.gives_back, self.calls, self.log = rss, gives_back, 0, []

    def trim(self) -> int:
        self.calls += 1
        self.log.append("trim")
        self.rss -= self.gives_back
        return 1

    def collect(self) -> int:
        self.log.append("collect")
        return 0

    def read_rss(self) -> int:
        return self.rss


def test_trims_once_per_interval_and_counts_the_rss_it_gave_back():
    heap = FakeHeap(rss=100 << 20, gives_back=3 << 20)
    timer = iter([0.0, 0.002, 0.010, 5.0, 5.001, 5.004]).__next__
    t = HeapTrimmer(60.0, start=1000.0, trim=heap.trim, rss=heap.read_rss, timer=timer, collect=heap.collect)
    assert t.maybe_trim(1059.9) is None and heap.calls == 0  # not before the first interval has passed
    assert t.maybe_trim(1060.0) == 3 << 20
    assert t.maybe_trim(1100.0) is None and heap.calls == 1  # the next is due one interval after that trim
    heap.gives_back = 1 << 20
    assert t.maybe_trim(1120.0) == 1 << 20
    assert heap.log == ["collect", "trim"] * 2  # the collection first: what it frees, the trim can give back
    stats = t.stats()
    assert (stats["last_collect_ms"], stats["last_trim_ms"]) == (1.0, 3.0)
    assert {k: v for k, v in stats.items() if k not in ("last_collect_ms", "last_trim_ms")} == {
        "interval_s": 60.0, "available": True, "trims": 2, "released_bytes": 4 << 20, "last_released_bytes": 1 << 20}


def test_interval_zero_or_no_glibc_never_trims():
    heap = FakeHeap(rss=100 << 20, gives_back=1 << 20)
    off = HeapTrimmer(0.0, start=0.0, trim=heap.trim, rss=heap.read_rss, collect=heap.collect)
    unavailable = HeapTrimmer(60.0, start=0.0, trim=None, rss=heap.read_rss, collect=heap.collect)
    for now in (0.0, 60.0, 1e6):
        assert off.maybe_trim(now) is None and unavailable.maybe_trim(now) is None
    assert heap.log == [] and not off.enabled and unavailable.stats()["available"] is False


def test_a_trim_that_frees_nothing_counts_zero_not_a_negative():
    heap = FakeHeap(rss=50 << 20, gives_back=-(1 << 20))  # the RSS rose meanwhile (another thread allocated)
    t = HeapTrimmer(1.0, start=0.0, trim=heap.trim, rss=heap.read_rss, collect=heap.collect)
    assert t.maybe_trim(1.0) == 0 and t.stats()["released_bytes"] == 0


def test_the_real_glibc_trim_runs_in_this_process():
    t = HeapTrimmer(1.0, start=0.0)
    if not t.stats()["available"]:
        return  # not glibc: nothing to call
    assert t.maybe_trim(1.0) is not None and t.trims == 1


def _free_tuples_of_length_20(capfd) -> int:
    capfd.readouterr()
    sys._debugmallocstats()  # CPython's allocator and free-list figures, on the C stderr
    m = re.search(r"^\s*([\d,]+) free 20-sized PyTupleObjects", capfd.readouterr().err, re.M)
    assert m, "no tuple free-list line in sys._debugmallocstats()"
    return int(m.group(1).replace(",", ""))


def test_the_real_collection_empties_the_interpreters_tuple_free_list(capfd):
    # CPython keeps up to 2,000 freed tuples of each length 1-20 for reuse, and only a full collection empties
    # the lists: left alone they fill to the largest burst a slow real model ever frees (a Gemma soak's RSS
    # grew ~3 KB a request for 25 minutes, much of it these). The trimmer's collection empties them.
    burst = [tuple(range(i, i + 20)) for i in range(3000)]
    del burst
    assert _free_tuples_of_length_20(capfd) == 2000
    heap = FakeHeap(rss=1 << 30, gives_back=0)
    HeapTrimmer(1.0, start=0.0, trim=heap.trim, rss=heap.read_rss).maybe_trim(1.0)  # the real gc.collect
    assert _free_tuples_of_length_20(capfd) < 20
