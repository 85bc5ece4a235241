"""PrefixCache: radix over full blocks, isolation by key, LRU leaves-first eviction."""

from __future__ import annotations

import pytest

from engine.core.kv.prefix_cache import PrefixCache, PrefixKey

BS = 4
K = PrefixKey(generation=1)


def toks(*runs: tuple[int, int]) -> list[int]:
    """Concatenate runs (start, count) of consecutive token ids."""
    out: list[int] = []
    for start, count in runs:
        out.extend(range(start, start + count))
    return out


def fresh(cache: PrefixCache, key: PrefixKey, tokens: list[int], blocks: list[int], unref: bool = True) -> None:
    assert cache.insert(key, tokens, blocks) == len(tokens) // BS
    if unref:
        for b in blocks[: len(tokens) // BS]:
            cache.mark_unreferenced(b)


def test_match_returns_longest_full_block_prefix() -> None:
    c = PrefixCache(BS)
    t = toks((0, 12))
    fresh(c, K, t, [7, 8, 9])
    assert c.match(K, t) == [7, 8, 9]
    assert c.match(K, t + [99, 98]) == [7, 8, 9]
    assert c.match(K, t[:6]) == [7]  # a match shorter than the cached path
    assert c.match(K, [5] + t[1:]) == []
    assert (c.hits, c.misses, c.hit_tokens) == (3, 1, 12 + 12 + 4)


def test_partial_last_block_is_never_cached() -> None:
    c = PrefixCache(BS)
    t = toks((0, 10))  # 2 full blocks + 2 tokens
    assert c.insert(K, t, [1, 2, 3]) == 2
    assert c.is_cached(1) and c.is_cached(2) and not c.is_cached(3)
    assert c.match(K, t) == [1, 2]


def test_shared_prefix_diverging_mid_tree_splits() -> None:
    c = PrefixCache(BS)
    a = toks((0, 12))
    b = a[:4] + [50, 51, 52, 53] + [60, 61, 62, 63]  # same first block, diverges at block 2
    fresh(c, K, a, [1, 2, 3])
    assert c.insert(K, b, [1, 20, 21]) == 3  # keeps block 1, branches below it
    assert c.match(K, a) == [1, 2, 3]
    assert c.match(K, b) == [1, 20, 21]
    mid = a[:4] + a[4:6] + [77, 78]  # diverges inside the second block
    assert c.match(K, mid) == [1]


def test_existing_prefix_keeps_its_block_and_insert_stops_there() -> None:
    c = PrefixCache(BS)
    t = toks((0, 12))
    fresh(c, K, t[:8], [1, 2])
    # a concurrent duplicate computed the same prefix into blocks 5, 6, 7
    assert c.insert(K, t, [5, 6, 7]) == 0
    assert not c.is_cached(5) and not c.is_cached(7)
    assert c.match(K, t) == [1, 2]


def test_generation_and_salt_isolate_entries() -> None:
    c = PrefixCache(BS)
    t = toks((0, 8))
    fresh(c, PrefixKey(1), t, [1, 2])
    assert c.match(PrefixKey(2), t) == []
    assert c.match(PrefixKey(1, salt="tenant-a"), t) == []
    fresh(c, PrefixKey(1, salt="tenant-a"), t, [3, 4])
    assert c.match(PrefixKey(1, salt="tenant-a"), t) == [3, 4]
    assert c.match(PrefixKey(1), t) == [1, 2]


def test_evict_is_lru_among_unreferenced() -> None:
    c = PrefixCache(BS)
    fresh(c, K, toks((0, 4)), [1])
    fresh(c, K, toks((100, 4)), [2])
    fresh(c, K, toks((200, 4)), [3])
    c.match(K, toks((0, 4)))  # block 1 becomes most recently used
    assert c.evict(1) == [2]
    assert c.evict(1) == [3]
    assert c.evict(5) == [1]
    assert len(c) == 0 and c.evictable() == 0


def test_evict_takes_leaves_before_parents_even_when_parent_is_older() -> None:
    c = PrefixCache(BS)
    fresh(c, K, toks((0, 12)), [1, 2, 3])  # chain 1 <- 2 <- 3
    fresh(c, K, toks((100, 4)), [9])  # newer single block
    # chain is older than block 9, but its root (1) must wait for 2 and 3
    assert c.evict(3) == [3, 2, 1]
    assert c.match(K, toks((100, 4))) == [9]


def test_eviction_never_takes_a_referenced_block() -> None:
    c = PrefixCache(BS)
    fresh(c, K, toks((0, 8)), [1, 2], unref=False)  # still held by a sequence
    fresh(c, K, toks((100, 4)), [3])
    assert c.evictable() == 1
    assert c.evict(10) == [3]
    assert c.is_cached(1) and c.is_cached(2)
    c.mark_unreferenced(2)
    assert c.evict(10) == [2]  # 1 still referenced
    assert c.is_cached(1)


def test_re_referenced_block_is_not_evicted() -> None:
    c = PrefixCache(BS)
    fresh(c, K, toks((0, 4)), [1])
    c.mark_referenced(1)
    assert c.evictable() == 0
    assert c.evict(1) == []
    c.mark_unreferenced(1)
    assert c.evict(1) == [1]


def test_ref_marks_must_alternate() -> None:
    c = PrefixCache(BS)
    fresh(c, K, toks((0, 4)), [1])
    with pytest.raises(AssertionError):
        c.mark_unreferenced(1)


def test_lookup_has_no_side_effects() -> None:
    c = PrefixCache(BS)
    fresh(c, K, toks((0, 4)), [1])
    fresh(c, K, toks((100, 4)), [2])
    assert c.lookup(K, toks((0, 4))) == [1]
    assert (c.hits, c.misses) == (0, 0)
    assert c.evict(1) == [1]  # lookup did not refresh block 1


def test_clear_and_drop_key() -> None:
    c = PrefixCache(BS)
    fresh(c, PrefixKey(1), toks((0, 8)), [1, 2])
    fresh(c, PrefixKey(2), toks((0, 4)), [3], unref=False)
    fresh(c, PrefixKey(2), toks((50, 4)), [4])
    assert sorted(c.drop_key(PrefixKey(2))) == [4]  # 3 was referenced: its holder frees it
    assert not c.is_cached(3)
    assert c.match(PrefixKey(1), toks((0, 8))) == [1, 2]
    assert sorted(c.clear()) == [1, 2]
    assert c.match(PrefixKey(1), toks((0, 8))) == [] and c.evictable() == 0
    c.check_invariants()


def test_extend_adds_only_the_new_blocks_below_the_held_path() -> None:
    c = PrefixCache(BS)
    t = toks((0, 16))
    assert c.extend(K, None, t, [1, 2, 3, 4], 0, 2) == 2  # a fresh sequence's first two full blocks
    assert c.extend(K, 2, t, [1, 2, 3, 4], 2, 3) == 3  # one more block filled
    assert c.match(K, t) == [1, 2, 3]
    assert c.extend(K, 3, t, [1, 2, 3, 4], 3, 4) == 4
    assert c.match(K, t) == [1, 2, 3, 4]
    c.check_invariants()


def test_extend_stops_at_a_concurrent_duplicate_like_insert() -> None:
    c = PrefixCache(BS)
    t = toks((0, 12))
    fresh(c, K, t[:4], [1], unref=False)
    fresh(c, K, t, [1, 2, 3], unref=False)  # another holder cached blocks 2, 3 below 1
    # a holder of block 1 that computed positions 1..2 into its own blocks 7, 8
    assert c.extend(K, 1, t, [1, 7, 8], 1, 3) == 1
    assert not c.is_cached(7) and not c.is_cached(8)
    assert c.match(K, t) == [1, 2, 3]


@pytest.mark.parametrize("grow", ["insert", "extend"])
def test_a_path_grown_recently_counts_as_recently_used_as_a_whole(grow: str) -> None:
    """`extend` does not touch the ancestors; an evicted leaf hands its age up, so LRU matches `insert`'s."""
    c = PrefixCache(BS)
    t = toks((0, 12))
    assert c.insert(K, t[:8], [1, 2]) == 2  # old path 1 <- 2, held
    assert c.insert(K, toks((100, 4)), [5]) == 1  # block 5: newer than the path's start, held
    if grow == "insert":
        assert c.insert(K, t, [1, 2, 4]) == 3
    else:
        assert c.extend(K, 2, t, [1, 2, 4], 2, 3) == 3
    for b in (1, 2, 4):
        c.mark_unreferenced(b)
    assert c.evict(1) == [4]  # the only unreferenced leaf
    c.mark_unreferenced(5)
    # block 2 was used (through 4) after block 5: 5 is the least recently used leaf
    assert c.evict(1) == [5]
    assert c.evict(2) == [2, 1]


def test_clear_and_drop_key_change_the_epoch() -> None:
    c = PrefixCache(BS)
    e0 = c.epoch
    fresh(c, K, toks((0, 4)), [1])
    c.evict(1)
    assert c.epoch == e0  # eviction never removes a held path: extend stays valid
    c.drop_key(K)
    assert c.epoch == e0 + 1
    c.clear()
    assert c.epoch == e0 + 2
