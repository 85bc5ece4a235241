"""The ref backend's KV swap format, by the C row copy and by its NumPy fallback: the same bytes as the
format's definition ([n, 2, layers, block_size, kv_heads, head_dim]), and a round trip into other blocks."""

from __future__ import annotations

import numpy as np

from native_switch import path  # noqa: F401 - the fixture: C library and fallback
from workers.paged_kv import PagedKvCache


def test_swap_out_is_the_format_and_swap_in_puts_it_back(path):
    c = PagedKvCache(layers=3, num_blocks=12, block_size=4, kv_heads=2, head_dim=5)
    rng = np.random.default_rng(0)
    c.k[:] = rng.standard_normal(c.k.shape)
    c.v[:] = rng.standard_normal(c.v.shape)
    b = np.array([7, 2, 9, 0])
    want = np.stack([np.stack([c.k[layer, i] for layer in range(3)]) for i in b])  # K of block i, per layer
    got = c.swap_out(b)
    assert got.shape == (4, 2, 3, 4, 2, 5)
    assert np.array_equal(got[:, 0], want)
    assert np.array_equal(got[:, 1], np.stack([np.stack([c.v[layer, i] for layer in range(3)]) for i in b]))
    others = np.array([1, 3, 4, 11])
    before = c.k[:, [5, 6]].copy()
    c.swap_in(others, got)
    assert np.array_equal(c.swap_out(others), got)
    assert np.array_equal(c.k[:, [5, 6]], before)  # blocks not named are untouched


def test_rows_in_place_make_the_same_records_as_swap_out(path):
    """An export gathers a block's layers straight from the cache into a slot: the record holds the swap
    format's bytes, and its CRC-32C is theirs."""
    import os

    import crc32c

    from ipc.kv_slots import KvSlotPool, record_bytes

    c = PagedKvCache(layers=3, num_blocks=12, block_size=4, kv_heads=2, head_dim=5)
    rng = np.random.default_rng(1)
    c.k[:] = rng.standard_normal(c.k.shape)
    c.v[:] = rng.standard_normal(c.v.shape)
    b = np.array([7, 2, 9, 0, 11])
    want = c.swap_out(b).reshape(len(b), -1).view(np.uint8)
    pool = KvSlotPool.create(f"nppkv{os.getpid()}", "0", 8, record_bytes(want.shape[1]))
    try:
        chains = [bytes([i + 1]) * 16 for i in range(len(b))]
        pool.write_many([4, 0, 6, 1, 2], 77, c.host_rows(b), chains)
        assert np.array_equal(pool.read_many([4, 0, 6, 1, 2], 77, chains, want.shape[1]), want)
        assert pool.headers()[[4, 0, 6, 1, 2]]["crc"].tolist() == [crc32c.crc32c(r) for r in want]
    finally:
        pool.close()
        pool.unlink()
