"""KV block records written and checked in batches: the CRC-32C against an independent implementation,
round trips between the batch and the single-record paths, corruption caught, records of the former
checksum (CRC-32) still read, and the same results without the C library."""

from __future__ import annotations

import os
import struct
import zlib

import crc32c
import numpy as np
import pytest

from ipc import kv_checksum
from ipc.kv_slots import HEADER_BYTES, MAGIC, KvSlotPool, RecordRefused, encode_record, read_record, record_bytes
from ipc.shm import list_segments, reap_stale
from native_switch import path  # noqa: F401 - the fixture: C library and fallback

PREFIX = f"npkvb{os.getpid()}"
LAYOUT = 0x1234_5678_9ABC_DEF0
NBYTES = 1000  # not a multiple of 8: the CRC's byte tail is exercised


@pytest.fixture
def pool():
    p = KvSlotPool.create(PREFIX, "0", 16, record_bytes(NBYTES))
    yield p
    p.close()
    p.unlink()
    reap_stale(PREFIX)
    assert list(list_segments(PREFIX)) == []


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, NBYTES), dtype=np.uint8)


def _chains(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 16 for i in range(n)]


def test_rows_crc32c_matches_the_crc32c_package(path):
    buf = np.random.default_rng(1).integers(0, 256, 50_000, dtype=np.uint8)
    for n, length in ((1, 0), (3, 13), (4, 64), (9, 1000), (7, 4097)):
        offs = np.random.default_rng(n).integers(0, buf.size - length, n)
        want = [crc32c.crc32c(buf[o:o + length]) for o in offs]
        assert kv_checksum.rows_crc32c(buf, offs, length).tolist() == want
        dst = np.zeros(n * length + 5, np.uint8)
        got = kv_checksum.rows_crc32c(buf, offs, length, dst, np.arange(n) * length + 5)
        assert got.tolist() == want
        assert all(np.array_equal(dst[5 + i * length:5 + (i + 1) * length], buf[o:o + length])
                   for i, o in enumerate(offs))
    assert kv_checksum.rows_crc32c(np.frombuffer(b"123456789", np.uint8), [0], 9).tolist() == [0xE3069283]


def test_rows_outside_the_buffers_are_refused(path):
    buf = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match="source"):
        kv_checksum.rows_crc32c(buf, [90], 20)
    with pytest.raises(ValueError, match="destination"):
        kv_checksum.rows_crc32c(buf, [0], 20, np.zeros(10, np.uint8), [0])


def test_batch_round_trip_and_agreement_with_the_single_record_path(path, pool):
    rows, chains, slots = _rows(10), _chains(10), [3, 0, 15, 7, 1, 2, 4, 5, 6, 8]
    pool.write_many(slots, LAYOUT, rows, chains)
    assert np.array_equal(pool.read_many(slots, LAYOUT, chains, NBYTES), rows)
    out = np.empty((10, NBYTES), np.uint8)
    assert pool.read_many(slots, LAYOUT, chains, NBYTES, out=out) is out and np.array_equal(out, rows)
    for i, s in enumerate(slots):  # each slot a whole record: the single reader and a block file agree
        assert bytes(read_record(pool.slot(s), LAYOUT, chains[i])) == rows[i].tobytes()
        assert bytes(read_record(memoryview(pool.raw(s)), LAYOUT, chains[i])) == rows[i].tobytes()
    for i in range(3):  # and single-record writes are read by the batch reader
        pool.put_raw(9 + i, encode_record(LAYOUT, rows[i], chains[i]))
    assert np.array_equal(pool.read_many([9, 10, 11], LAYOUT, chains[:3], NBYTES), rows[:3])


@pytest.mark.parametrize("where", [0, NBYTES // 2, NBYTES - 1])
def test_a_flipped_bit_is_refused_naming_its_slot(path, pool, where):
    rows, chains, slots = _rows(6), _chains(6), [0, 1, 2, 3, 4, 5]
    pool.write_many(slots, LAYOUT, rows, chains)
    pool.slot(4)[HEADER_BYTES + where] ^= 0x10
    with pytest.raises(RecordRefused, match="host slot 4") as e:
        pool.read_many(slots, LAYOUT, chains, NBYTES)
    assert e.value.cause == "checksum"
    with pytest.raises(RecordRefused) as e:
        read_record(pool.slot(4), LAYOUT)
    assert e.value.cause == "checksum"
    assert np.array_equal(pool.read_many(slots[:4], LAYOUT, chains[:4], NBYTES), rows[:4])


def _legacy_record(payload: bytes, chain: bytes) -> bytes:
    """A record as written before CRC-32C: zlib's CRC-32 and 0 in the (then padding) algorithm word."""
    head = struct.pack("<QQQII16s", MAGIC, LAYOUT, len(payload), zlib.crc32(payload), 0, chain)
    return head.ljust(HEADER_BYTES, b"\0") + payload


def test_records_of_the_former_checksum_are_still_read_and_checked(path, pool):
    rows, chains = _rows(3), _chains(3)
    for i in range(3):
        pool.put_raw(i, _legacy_record(rows[i].tobytes(), chains[i]))
    pool.write_many([3], LAYOUT, rows[:1], chains[:1])  # a batch mixing both kinds
    assert np.array_equal(pool.read_many([0, 1, 2, 3], LAYOUT, chains + chains[:1], NBYTES),
                          np.concatenate([rows, rows[:1]]))
    assert bytes(read_record(pool.slot(1), LAYOUT, chains[1])) == rows[1].tobytes()
    pool.slot(2)[HEADER_BYTES + 7] ^= 1
    with pytest.raises(RecordRefused, match="host slot 2"):
        pool.read_many([0, 1, 2], LAYOUT, chains, NBYTES)
    with pytest.raises(RecordRefused):
        read_record(pool.slot(2), LAYOUT)


def test_an_unknown_checksum_algorithm_is_refused(path, pool):
    rows, chains = _rows(2), _chains(2)
    pool.write_many([0, 1], LAYOUT, rows, chains)
    pool.headers()["algo"][1] = 7  # a future writer's algorithm this reader does not know
    with pytest.raises(RecordRefused, match="unknown checksum algorithm") as e:
        pool.read_many([0, 1], LAYOUT, chains, NBYTES)
    assert e.value.cause == "checksum"
    with pytest.raises(RecordRefused, match="unknown checksum algorithm"):
        read_record(pool.slot(1), LAYOUT)


def test_new_records_carry_crc32c(path, pool):
    rows, chains = _rows(2), _chains(2)
    pool.write_many([0, 1], LAYOUT, rows, chains)
    h = pool.headers()[[0, 1]]
    assert h["algo"].tolist() == [kv_checksum.ALGO_CRC32C] * 2
    assert h["crc"].tolist() == [crc32c.crc32c(r) for r in rows]
    rec = encode_record(LAYOUT, rows[0], chains[0])
    assert struct.unpack_from("<II", rec, 24) == (crc32c.crc32c(rows[0]), kv_checksum.ALGO_CRC32C)
