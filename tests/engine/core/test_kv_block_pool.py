"""BlockPool: allocation, ref counts, and quarantine keep blocks out of circulation."""

from __future__ import annotations

import pytest

from engine.core.kv.block_pool import BlockPool, OutOfBlocks


def test_allocate_hands_out_distinct_blocks_with_one_ref() -> None:
    pool = BlockPool(4, 16)
    got = pool.allocate(3)
    assert len(set(got)) == 3
    assert all(pool.refcount(b) == 1 for b in got)
    assert pool.num_free() == 1


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3, 16)
    pool.allocate(2)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    assert pool.num_free() == 1


def test_freed_block_is_reused() -> None:
    pool = BlockPool(2, 16)
    a, b = pool.allocate(2)
    assert pool.decref(a) == 0
    pool.free(a)
    assert pool.allocate(1) == [a]


def test_decref_returns_new_count_and_free_requires_zero() -> None:
    pool = BlockPool(2, 16)
    (a,) = pool.allocate(1)
    pool.incref(a)
    assert pool.decref(a) == 1
    with pytest.raises(AssertionError):
        pool.free(a)
    assert pool.decref(a) == 0
    pool.free(a)
    with pytest.raises(AssertionError):
        pool.free(a)  # double free
    with pytest.raises(AssertionError):
        pool.incref(a)  # a free block cannot gain references


def test_decref_below_zero_is_refused() -> None:
    pool = BlockPool(1, 16)
    (a,) = pool.allocate(1)
    pool.decref(a)
    with pytest.raises(AssertionError):
        pool.decref(a)


def test_quarantined_blocks_are_never_allocated_until_released() -> None:
    pool = BlockPool(3, 16)
    blocks = pool.allocate(3)
    for b in blocks[:2]:
        pool.decref(b)
    pool.quarantine(blocks[:2])
    assert pool.num_free() == 0 and pool.num_quarantined() == 2
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.free(blocks[0])
    assert pool.release_quarantine() == sorted(blocks[:2])
    assert sorted(pool.allocate(2)) == sorted(blocks[:2])


def test_quarantine_refuses_a_referenced_block() -> None:
    pool = BlockPool(1, 16)
    (a,) = pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.quarantine([a])


def test_invalid_ids_rejected() -> None:
    pool = BlockPool(2, 16)
    with pytest.raises(ValueError):
        pool.incref(5)
    with pytest.raises(ValueError):
        BlockPool(0, 16)
