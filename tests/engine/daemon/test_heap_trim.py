"""The daemon's malloc_trim schedule and accounting (board.malloc_trim_interval_s), on a fake clock and heap."""

from engine.daemon.heap_trim import HeapTrimmer


class FakeHeap:
    """An RSS that a trim lowers by `gives_back` bytes."""

    def __init__(self, rss: int, gives_back: int) -> None:
        self.rss, self.gives_back, self.calls = rss, gives_back, 0

    def trim(self) -> int:
        self.calls += 1
        self.rss -= self.gives_back
        return 1

    def read_rss(self) -> int:
        return self.rss


def test_trims_once_per_interval_and_counts_the_rss_it_gave_back():
    heap = FakeHeap(rss=100 << 20, gives_back=3 << 20)
    t = HeapTrimmer(60.0, start=1000.0, trim=heap.trim, rss=heap.read_rss, timer=iter(range(100)).__next__)
    assert t.maybe_trim(1059.9) is None and heap.calls == 0  # not before the first interval has passed
    assert t.maybe_trim(1060.0) == 3 << 20
    assert t.maybe_trim(1100.0) is None and heap.calls == 1  # the next is due one interval after that trim
    heap.gives_back = 1 << 20
    assert t.maybe_trim(1120.0) == 1 << 20
    assert t.stats() == {"interval_s": 60.0, "available": True, "trims": 2, "released_bytes": 4 << 20,
                         "last_released_bytes": 1 << 20, "last_trim_ms": 1000.0}


def test_interval_zero_or_no_glibc_never_trims():
    heap = FakeHeap(rss=100 << 20, gives_back=1 << 20)
    off = HeapTrimmer(0.0, start=0.0, trim=heap.trim, rss=heap.read_rss)
    unavailable = HeapTrimmer(60.0, start=0.0, trim=None, rss=heap.read_rss)
    for now in (0.0, 60.0, 1e6):
        assert off.maybe_trim(now) is None and unavailable.maybe_trim(now) is None
    assert heap.calls == 0 and not off.enabled and unavailable.stats()["available"] is False


def test_a_trim_that_frees_nothing_counts_zero_not_a_negative():
    heap = FakeHeap(rss=50 << 20, gives_back=-(1 << 20))  # the RSS rose meanwhile (another thread allocated)
    t = HeapTrimmer(1.0, start=0.0, trim=heap.trim, rss=heap.read_rss)
    assert t.maybe_trim(1.0) == 0 and t.stats()["released_bytes"] == 0


def test_the_real_glibc_trim_runs_in_this_process():
    t = HeapTrimmer(1.0, start=0.0)
    if not t.stats()["available"]:
        return  # not glibc: nothing to call
    assert t.maybe_trim(1.0) is not None and t.trims == 1
