"""KV_EXPORT / KV_IMPORT in the worker, per backend: bytes out of one chip, into other blocks of another.

Each backend exports blocks into a real shared-memory slot pool (and block
files), a second instance of it (another worker) imports them into other
block ids, and exports those again: the same bytes. The stub and the sim keep
no KV of their own, so there they run under a subclass that keeps what it is
given. Records of another layout, or damaged ones, are refused before
anything is written.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.tier_transfers import DISK, HOST, chain_words
from ipc.kv_slots import KvSlotPool, RecordRefused, record_bytes
from ipc.records import Job, JobKind
from workers.backends.ctypes_backend import CtypesBackend, build_reference_library
from workers.backends.ref import RefBackend
from workers.backends.sim import SimBackend
from workers.backends.stub import StubBackend
from workers.kv_transfer import HostKv

CHAINS = [bytes([i]) * 16 for i in range(1, 4)]


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return str(build_reference_library(tmp_path_factory.mktemp("lib")))


def _keeping(cls):
    """The stub and the sim keep no KV (swap_out is nominal zeros, swap_in only checks the shape): this
    subclass keeps what swap_in wrote, so the bytes compared are the bytes the transfer moved."""

    class Keeping(cls):
        def swap_out(self, blocks: np.ndarray) -> np.ndarray:
            out = super().swap_out(blocks)  # the backend's own id and shape checks (and the sim's queue time)
            kept = self.__dict__.setdefault("kept", {})
            for i, blk in enumerate(np.asarray(blocks).tolist()):
                if blk in kept:
                    out[i] = kept[blk]
            return out

        def swap_in(self, blocks: np.ndarray, data: np.ndarray) -> None:
            super().swap_in(blocks, data)
            kept = self.__dict__.setdefault("kept", {})
            for blk, d in zip(np.asarray(blocks).tolist(), data):
                kept[blk] = np.array(d)

    return Keeping


def _make(kind: str, library: str, keep: bool = False, **kw):
    if kind == "ref":
        b = RefBackend(num_blocks=16)
    elif kind == "stub":
        b = (_keeping(StubBackend) if keep else StubBackend)(num_blocks=16, **kw)
    elif kind == "sim":
        b = (_keeping(SimBackend) if keep else SimBackend)(num_blocks=16, time_scale=0.01, **kw)
    else:
        b = CtypesBackend(library=library, num_blocks=16, block_size=16)
    b.load(None)
    return b


def _fill(b) -> None:
    """Give the device KV recognisable content: different in every block and position."""
    if isinstance(b, RefBackend):
        c = b.cache
        c.k[:] = np.random.default_rng(1).standard_normal(c.k.shape)
        c.v[:] = np.random.default_rng(2).standard_normal(c.v.shape)
    else:  # device-resident KV (the library's pool, reached through the ABI) or the kept one
        ids = np.arange(b.num_blocks)
        out = b.swap_out(ids)
        rng = np.random.default_rng(3)
        b.swap_in(ids, rng.integers(0, 255, out.shape, dtype=np.uint8) if out.dtype == np.uint8
                  else rng.standard_normal(out.shape).astype(out.dtype))


def _job(kind: JobKind, src, dst, where) -> Job:
    job = Job.kv_copy(7, 1, src, dst, kind=kind)
    job.tokens = chain_words(CHAINS[:len(src)])
    job.positions = np.asarray(where, np.int32)
    return Job.from_arrays(job.to_arrays())  # as read from the ring


@pytest.mark.parametrize("kind", ["ref", "stub", "sim", "ctypes"])
def test_export_then_import_on_another_worker_moves_the_same_bytes(kind, library, tmp_path):
    a, b = _make(kind, library, keep=True), _make(kind, library, keep=True)
    _fill(a)
    src, dst = np.array([3, 5, 9]), np.array([10, 2, 7])
    sent = a.swap_out(src)
    # the comparison can fail: each block its own bytes, and the destination blocks held other bytes before
    assert len({blk.tobytes() for blk in sent}) == len(src) and all(np.any(blk != 0) for blk in sent)
    before = b.swap_out(dst)
    assert not any(np.array_equal(x, y) for x, y in zip(sent, before))
    info = a.describe()
    assert info.kv_transfer is not None
    pool = KvSlotPool.create("npuservetest", "0", 8, record_bytes(info.kv.block_bytes()))
    try:
        ha, hb = HostKv(pool, a, info, str(tmp_path)), HostKv(pool, b, b.describe(), str(tmp_path))
        ha.run(_job(JobKind.KV_EXPORT, [3, 5, 9], [0, 1, -1], [HOST, HOST | DISK, DISK]))
        hb.run(_job(JobKind.KV_IMPORT, [0, 1, -1], [10, 2, 7], [HOST, DISK, DISK]))
        np.testing.assert_array_equal(b.swap_out(dst), sent)
    finally:
        pool.close()
        pool.unlink()


def test_import_of_another_layout_or_damaged_record_is_refused_untouched(library, tmp_path):
    ref, other = _make("ref", library), _make("stub", library, block_size=16)
    _fill(ref)
    info = ref.describe()
    pool = KvSlotPool.create("npuservetest", "0", 4, record_bytes(info.kv.block_bytes()))
    try:
        HostKv(pool, ref, info, str(tmp_path)).run(_job(JobKind.KV_EXPORT, [1, 2], [0, 1], [HOST, HOST]))
        with pytest.raises(RecordRefused) as e:  # another layout (stub's nominal KV)
            HostKv(pool, other, other.describe()).run(_job(JobKind.KV_IMPORT, [0], [4], [HOST]))
        assert e.value.cause == "layout"
        fresh = _make("ref", library)
        before = fresh.swap_out(np.array([4, 5]))
        pool.slot(1)[200] ^= 0xFF  # a flipped bit in the second record
        with pytest.raises(RecordRefused) as e:
            HostKv(pool, fresh, fresh.describe()).run(_job(JobKind.KV_IMPORT, [0, 1], [4, 5], [HOST, HOST]))
        assert e.value.cause == "checksum"
        assert np.array_equal(fresh.swap_out(np.array([4, 5])), before)  # the good first record wrote nothing
        with pytest.raises(RecordRefused) as e:  # the wrong prefix in a slot
            job = _job(JobKind.KV_IMPORT, [0], [4], [HOST])
            job.tokens = chain_words([CHAINS[2]])
            HostKv(pool, fresh, fresh.describe()).run(job)
        assert e.value.cause == "chain"
        with pytest.raises(RecordRefused) as e:
            HostKv(pool, fresh, fresh.describe(), str(tmp_path)).run(_job(JobKind.KV_IMPORT, [-1], [4], [DISK]))
        assert e.value.cause == "missing"
    finally:
        pool.close()
        pool.unlink()
