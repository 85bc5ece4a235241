"""PrefixCache.journal: the changes a shell publishes as KV events (engine/daemon/kv_events.py).

The property: replaying the journal from an empty cache rebuilds exactly what the cache holds, every
block with its parent and tokens, whatever mix of inserts, extends, evictions, clears and key drops
happened; with the journal off nothing is recorded.
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from engine.core.kv.prefix_cache import PrefixCache, PrefixKey

BS = 4
K = PrefixKey(generation=1)


def replay(journal: list[tuple], into: dict[int, tuple[int | None, tuple[int, ...]]]) -> None:
    """Apply journal entries to {block: (parent block, edge tokens)}, checking each is consistent."""
    for entry in journal:
        if entry[0] == "stored":
            _, parent, chain = entry
            assert parent is None or parent in into, f"stored below unknown block {parent}"
            for block, edge in chain:
                assert block not in into, f"block {block} stored twice"
                assert len(edge) == BS
                into[block] = (parent, tuple(edge))
                parent = block
        else:
            assert entry[0] == "removed"
            for block in entry[1]:
                assert block in into, f"removed unknown block {block}"
                del into[block]


def contents(c: PrefixCache) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    return {b: (None if n.parent is None else n.parent.block, n.edge) for b, n in c._by_block.items()}


def test_insert_extend_evict_clear_are_journaled_in_order() -> None:
    c = PrefixCache(BS)
    c.journal = []
    t = list(range(16))
    assert c.insert(K, t[:8], [1, 2]) == 2
    assert c.extend(K, 2, t, [1, 2, 3, 4], 2, 4) == 4
    assert c.insert(K, t[:8], [1, 2]) == 2  # already cached: nothing new
    for b in (4, 3):
        c.mark_unreferenced(b)
    assert c.evict(1) == [4]
    assert c.journal == [("stored", None, [(1, (0, 1, 2, 3)), (2, (4, 5, 6, 7))]),
                         ("stored", 2, [(3, (8, 9, 10, 11)), (4, (12, 13, 14, 15))]),
                         ("removed", [4])]
    c.journal.clear()
    assert sorted(c.clear()) == [1, 2, 3]
    assert c.journal == [("removed", [1, 2, 3])]


def test_drop_key_journals_referenced_blocks_too() -> None:
    c = PrefixCache(BS)
    c.journal = []
    c.insert(PrefixKey(2), list(range(8)), [5, 6])  # still referenced by its inserter
    c.journal.clear()
    assert c.drop_key(PrefixKey(2)) == []  # nothing for the caller to free ...
    assert c.journal == [("removed", [5, 6])] or c.journal == [("removed", [6, 5])]  # ... but both are gone


def test_no_journal_by_default() -> None:
    c = PrefixCache(BS)
    c.insert(K, list(range(8)), [1, 2])
    assert c.journal is None


ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 3), st.integers(1, 4), st.integers(0, 1)),
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("evict"), st.integers(1, 3)),
    st.tuples(st.just("clear")),
    st.tuples(st.just("drop"), st.integers(0, 1)),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_replaying_the_journal_rebuilds_the_cache(script) -> None:
    c = PrefixCache(BS)
    c.journal = []
    mirror: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    stems = [[(7 * i + s) % 3 for i in range(4 * BS)] for s in range(4)]
    next_block = 0
    holders: list[list[int]] = []  # each holds its whole cached path, as a sequence does
    refs: dict[int, int] = {}

    def release(path: list[int]) -> None:
        for b in path:
            refs[b] -= 1
            if refs[b] == 0 and c.is_cached(b):
                c.mark_unreferenced(b)

    for op in script:
        if op[0] == "insert":
            _, stem, n_blocks, gen = op
            tokens = stems[stem][: n_blocks * BS]
            key = PrefixKey(1 + gen)
            have = c.lookup(key, tokens)
            for b in have:
                if refs.get(b, 0) == 0:
                    c.mark_referenced(b)
            fresh = list(range(next_block, next_block + n_blocks - len(have)))
            next_block += len(fresh)
            done = c.insert(key, tokens, have + fresh)
            path = (have + fresh)[:done]
            for b in path:
                refs[b] = refs.get(b, 0) + 1
            holders.append(path)
        elif op[0] == "release" and holders:
            release(holders.pop(op[1] % len(holders)))
        elif op[0] == "evict":
            c.evict(op[1])
        elif op[0] == "clear":
            c.clear()
        elif op[0] == "drop":
            c.drop_key(PrefixKey(1 + op[1]))
        replay(c.journal, mirror)
        c.journal.clear()
        assert mirror == contents(c)
    c.check_invariants()
