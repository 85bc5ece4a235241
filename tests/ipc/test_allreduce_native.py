"""The all-reduce's C step against its NumPy step: the same bits, the late-peer path, and the fallback
when no C compiler is present. Ranks are threads with their own mappings (ctypes releases the GIL)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from ipc import kv_checksum, native_lib
from ipc.allreduce import _ARRIVE, AllReduce, create_group
from ipc.shm import list_segments, reap_stale
from native_switch import use_native

PREFIX = f"nptarc{os.getpid()}"
SLOT = 4096


@pytest.fixture(autouse=True)
def cleanup():
    yield
    native_lib.reset()
    reap_stale(PREFIX)
    assert list(list_segments(PREFIX)) == []


def _part(call: int, rank: int, size: int) -> np.ndarray:
    return np.random.default_rng((call, rank)).standard_normal(size).astype(np.float32) * 10 ** rank


def _run(world: int, sizes: list[int], before=None) -> list[list[np.ndarray]]:
    seg = create_group(PREFIX, world, SLOT, prefix=PREFIX)
    outs: list[list[np.ndarray]] = [[] for _ in range(world)]
    errors: list[BaseException] = []
    handles = [AllReduce(seg.name, r, timeout_s=20) for r in range(world)]
    if before:
        before(handles)

    def rank(r: int) -> None:
        try:
            for call, size in enumerate(sizes):
                outs[r].append(handles[r].allreduce(_part(call, r, size)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            handles[r].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for h in handles:
            h.close()
        seg.close()
        seg.unlink()
    assert not errors, errors
    return outs


SIZES = [0, 1, 7, 1023, 1024, 1025, 3000]  # within a slot (1024 floats) and across slot boundaries


def _expected(world: int, call: int, size: int) -> np.ndarray:
    parts = [_part(call, r, size) for r in range(world)]
    out = parts[0] + parts[1]
    for p in parts[2:]:
        out += p
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_c_and_numpy_steps_give_the_same_bits(monkeypatch, world):
    use_native(monkeypatch, True)
    c = _run(world, SIZES)
    use_native(monkeypatch, False)
    py = _run(world, SIZES)
    for call, size in enumerate(SIZES):
        want = _expected(world, call, size)  # rank order, float32: ((x0 + x1) + x2)
        for r in range(world):
            assert c[r][call].tobytes() == py[r][call].tobytes() == want.tobytes(), (world, call, size, r)


def test_a_late_peer_goes_through_the_python_barrier_and_still_sums(monkeypatch):
    """Rank 1 starts only once rank 0 has published and (spin budget 0) handed the wait to Python."""
    use_native(monkeypatch, True)
    import ipc.allreduce as mod

    waits = []
    real_wait = mod.AllReduce._wait

    def counting_wait(self, word, n, spun_s=0.0):
        waits.append((self.rank, n))
        return real_wait(self, word, n, spun_s)

    monkeypatch.setattr(mod.AllReduce, "_wait", counting_wait)
    seg = create_group(PREFIX, 2, SLOT, prefix=PREFIX)
    a, b = AllReduce(seg.name, 0, timeout_s=20), AllReduce(seg.name, 1, timeout_s=20)
    a._ctx[9] = 0  # no spin in C: a peer not there yet is left to the Python barrier
    got = {}
    try:
        t = threading.Thread(target=lambda: got.setdefault(0, a.allreduce(_part(0, 0, 500))))
        t.start()
        hdr = b._hdr
        while not waits:  # rank 0 is in the Python barrier (its slot published)
            assert t.is_alive()
            time.sleep(0.001)
        assert int(hdr[0, _ARRIVE]) == 1
        got[1] = b.allreduce(_part(0, 1, 500))
        t.join(60)
    finally:
        a.close()
        b.close()
        seg.close()
        seg.unlink()
    assert waits[0] == (0, 1)
    assert got[0].tobytes() == got[1].tobytes() == _expected(2, 0, 500).tobytes()


def test_without_a_compiler_both_hot_paths_fall_back(monkeypatch, tmp_path):
    monkeypatch.setenv("NPUSERVE_NATIVE", "1")
    monkeypatch.setenv("NPUSERVE_CACHE_DIR", str(tmp_path))  # nothing cached: it must build, and cannot
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native_lib.reset()
    assert native_lib.library() is None
    assert "compiler" in native_lib.why_not
    out = _run(2, [5, 1500])
    assert out[0][1].tobytes() == _expected(2, 1, 1500).tobytes()
    rows = np.frombuffer(b"123456789" * 2, np.uint8)
    got = kv_checksum.rows_crc32c(rows, np.array([0, 9]), 9)
    assert got.tolist() == [0xE3069283, 0xE3069283]  # the CRC-32C check value of "123456789"
