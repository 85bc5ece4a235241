"""A ring's resident memory follows its occupancy, not its capacity.

Every shared-memory page the writer's head passes over stays resident in both
processes. A daemon's rings are 64 MiB and almost always nearly empty; a head
that marched through the whole capacity before wrapping would grow the
scheduler's and the workers' RSS linearly for hours under steady load.
"""

from __future__ import annotations

import numpy as np
import pytest

from shm_sweep import sweep_shm
from ipc.ring import REWIND_AFTER, Ring

PREFIX = "npuservetestfp"
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    sweep_shm(PREFIX)


def _rss_shmem_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    pytest.fail("no RssShmem in /proc/self/status")


def test_steady_write_read_keeps_few_ring_pages_resident():
    """32 MiB of records through a 16 MiB ring, read as they come: about REWIND_AFTER stays resident."""
    with Ring.create(PREFIX, 0, 16 * MIB, "w") as ring:
        reader = Ring.attach(ring.name)
        try:
            before = _rss_shmem_kib()
            payload = np.arange(4096, dtype=np.int32)  # 16 KiB records, like a long prefill job
            for i in range(2048):
                ring.write({"x": payload, "i": np.array([i])})
                out = reader.read()
                assert out is not None and int(out["i"][0]) == i
                np.testing.assert_array_equal(out["x"], payload)
            grown_kib = _rss_shmem_kib() - before
        finally:
            reader.close()
    # Both mappings (writer and reader) count; without the rewind this was 2 x 16 MiB.
    assert grown_kib <= 2 * (REWIND_AFTER + MIB) // 1024, f"ring pages resident: {grown_kib} KiB"


def test_a_lagging_reader_still_gets_every_record_across_early_rewinds():
    """The rewind happens only when the ring is empty; a backlog is read in order, intact."""
    with Ring.create(PREFIX, 0, 4 * MIB, "lag") as ring:
        reader = Ring.attach(ring.name)
        try:
            rng = np.random.default_rng(3)
            sent: list[np.ndarray] = []
            got = 0
            for burst in range(60):
                for _ in range(int(rng.integers(1, 40))):
                    a = rng.integers(0, 1 << 30, size=int(rng.integers(1, 8192)), dtype=np.int32)
                    ring.write({"a": a}, timeout=None)
                    sent.append(a)
                # drain all (empty: the next write may rewind) or only part (no rewind allowed)
                keep = 0 if burst % 2 else int(rng.integers(1, 5))
                while got < len(sent) - keep:
                    out = reader.read()
                    np.testing.assert_array_equal(out["a"], sent[got])
                    got += 1
            while got < len(sent):
                np.testing.assert_array_equal(reader.read()["a"], sent[got])
                got += 1
            assert reader.read() is None
        finally:
            reader.close()
