"""KvManager: sequence transitions, prefix sharing, failure quarantine, chip recovery."""

from __future__ import annotations

import pytest

from engine.core.kv import (
    KvManager,
    KvSequenceState as S,
    KvStateError,
    OutOfBlocks,
    PrefixKey,
    StaleJob,
)

BS = 4
K = PrefixKey(1)


def mgr(num_blocks: int = 16, max_seq: int = 64, cache: bool = True) -> KvManager:
    return KvManager(chip=0, num_blocks=num_blocks, block_size=BS, max_seq=max_seq, prefix_cache=cache, paranoid=True)


def prefill(m: KvManager, seq: int, prompt: list[int], reserve: int, job: int, key: PrefixKey | None = K) -> int:
    cached = m.reserve(seq, 1, prompt, reserve, key)
    m.begin_update(seq, job, len(prompt))
    m.commit(seq, job, prompt)
    return cached


def test_reserve_commit_release_round_trip_returns_every_block() -> None:
    m = mgr()
    assert m.reserve(1, 1, list(range(10)), 13, K) == 0
    assert len(m.block_table(1)) == 4 and m.state(1) is S.RESERVED
    m.begin_update(1, 7, 10)
    assert m.state(1) is S.UPDATING and m.sequence(1).committed_len == 0
    m.commit(1, 7, list(range(10)))
    seq = m.sequence(1)
    assert (seq.state, seq.committed_len, seq.reserved_len) == (S.ACTIVE, 10, 13)
    m.release(1)
    assert m.state(1) is S.FREE and 1 not in m
    # two full blocks stay cached (evictable), the rest went back to the free list
    st = m.stats()["blocks"]
    assert (st["free"], st["evictable"], st["used"]) == (14, 2, 0)
    assert m.available_blocks() == 16


def test_prefix_hit_shares_blocks_and_reports_cached_len() -> None:
    m = mgr()
    prompt = list(range(10))
    prefill(m, 1, prompt, 12, job=1)
    cached = m.reserve(2, 1, prompt + [77, 78], 14, K)
    assert cached == 8
    t1, t2 = m.block_table(1), m.block_table(2)
    assert t2[:2] == t1[:2] and set(t2[2:]).isdisjoint(t1)
    assert m.sequence(2).committed_len == 8  # the next job starts at the first uncached position
    assert m.pool.refcount(t1[0]) == 2
    assert m.stats()["prefix"]["hits"] == 1


def test_at_least_one_prompt_token_is_computed() -> None:
    m = mgr()
    prompt = list(range(8))  # exactly two full blocks
    prefill(m, 1, prompt, 8, job=1)
    assert m.reserve(2, 1, prompt, 8, K) == 4  # not 8: the last token must produce logits
    m.begin_update(2, 2, 8)


def test_different_generation_or_salt_does_not_share() -> None:
    m = mgr()
    prompt = list(range(10))
    prefill(m, 1, prompt, 10, job=1)
    assert m.reserve(2, 2, prompt, 10, PrefixKey(2)) == 0
    assert m.reserve(3, 1, prompt, 10, PrefixKey(1, "tenant-b")) == 0
    assert m.reserve(4, 1, prompt, 10, None) == 0
    assert m.reserve(5, 1, prompt, 10, K) == 8


def test_cache_disabled_never_shares() -> None:
    m = mgr(cache=False)
    prompt = list(range(10))
    prefill(m, 1, prompt, 10, job=1)
    m.release(1)
    assert m.reserve(2, 1, prompt, 10, K) == 0
    assert m.stats()["blocks"]["cached"] == 0


def test_out_of_blocks_leaves_no_trace() -> None:
    m = mgr(num_blocks=4)
    prefill(m, 1, list(range(8)), 8, job=1)
    m.release(1)  # 2 cached evictable + 2 free
    before = (m.stats(), m.cache.hits, m.cache.misses)
    with pytest.raises(OutOfBlocks):
        m.reserve(2, 1, list(range(100, 120)), 20, K)  # 5 blocks > 4
    assert (m.stats(), m.cache.hits, m.cache.misses) == before
    assert 2 not in m


def test_reserve_evicts_lru_cached_blocks_but_never_blocks_in_use() -> None:
    m = mgr(num_blocks=6)
    prefill(m, 1, list(range(8)), 8, job=1)  # blocks cached, still held by seq 1
    prefill(m, 2, list(range(100, 108)), 8, job=2)
    m.release(2)  # seq 2's 2 blocks: cached and evictable
    held = set(m.block_table(1))
    assert m.available_blocks() == 4
    m.reserve(3, 1, list(range(200, 216)), 16, K)  # needs all 4: evicts seq 2's blocks
    assert set(m.block_table(3)).isdisjoint(held)
    assert m.stats()["prefix"]["evictions"] == 2
    assert m.available_blocks() == 0


def test_reserve_revives_unreferenced_cached_prefix_and_counts_it() -> None:
    m = mgr(num_blocks=3)
    prompt = list(range(8)) + [9]
    prefill(m, 1, prompt, 9, job=1)
    m.release(1)  # 2 evictable + 1 free
    # needs 3 blocks; 2 come from the cache hit, 1 fresh: fits even though a miss would too
    assert m.reserve(2, 1, prompt, 9, K) == 8
    assert m.available_blocks() == 0
    with pytest.raises(OutOfBlocks):
        m.reserve(3, 1, [1], 1, K)


def test_revived_blocks_are_not_double_counted_as_available() -> None:
    m = mgr(num_blocks=4)
    prompt = list(range(8)) + [9]
    prefill(m, 1, prompt, 9, job=1)
    m.release(1)  # 2 evictable (the prefix) + 2 free
    # 4 blocks needed, 2 matched -> 2 fresh; available after reviving = 2: fits
    assert m.reserve(2, 1, prompt, 16, K) == 8
    m.release(2)
    # 5 blocks needed, 2 matched -> 3 fresh but only 2 exist beyond the revived prefix
    with pytest.raises(OutOfBlocks):
        m.reserve(3, 1, prompt, 20, K)
    m.check_invariants()


def test_grow_adds_blocks_and_refuses_when_dry() -> None:
    m = mgr(num_blocks=4)
    m.reserve(1, 1, [1, 2, 3], 4, None)
    assert m.grow(1, 4) and len(m.block_table(1)) == 1  # no-op
    assert m.grow(1, 12) and len(m.block_table(1)) == 3
    m.reserve(2, 1, [1], 4, None)
    assert m.grow(1, 13) is False
    assert m.sequence(1).reserved_len == 12 and len(m.block_table(1)) == 3
    with pytest.raises(ValueError):
        m.grow(1, 65)


def test_begin_update_bounds_and_states() -> None:
    m = mgr()
    m.reserve(1, 1, [1, 2, 3], 8, None)
    with pytest.raises(ValueError):
        m.begin_update(1, 1, 9)  # beyond reserved_len
    with pytest.raises(ValueError):
        m.begin_update(1, 1, 0)  # must write at least one token
    m.begin_update(1, 1, 3)
    with pytest.raises(KvStateError):
        m.begin_update(1, 2, 4)  # one job at a time
    with pytest.raises(KvStateError):
        m.begin_update(99, 1, 1)


def test_stale_completions_raise_and_leave_state_alone() -> None:
    m = mgr()
    m.reserve(1, 1, [1, 2, 3], 8, None)
    m.begin_update(1, 5, 3)
    with pytest.raises(StaleJob):
        m.commit(1, 4, [1, 2, 3])
    with pytest.raises(StaleJob):
        m.fail(1, 6)
    with pytest.raises(StaleJob):
        m.commit(42, 5, [1, 2, 3])
    assert m.state(1) is S.UPDATING and m.sequence(1).committed_len == 0
    m.commit(1, 5, [1, 2, 3, 4])  # extra tokens beyond new_len are ignored
    with pytest.raises(StaleJob):
        m.commit(1, 5, [1, 2, 3])  # duplicate completion
    assert m.sequence(1).committed_len == 3


def test_commit_grows_committed_len_and_caches_new_full_blocks() -> None:
    m = mgr()
    prompt = [1, 2, 3]
    m.reserve(1, 1, prompt, 10, K)
    m.begin_update(1, 1, 3)
    m.commit(1, 1, prompt)
    assert m.stats()["blocks"]["cached"] == 0
    m.begin_update(1, 2, 4)
    m.commit(1, 2, prompt + [40])
    assert m.stats()["blocks"]["cached"] == 1
    assert m.cached_prefix_len(K, prompt + [40, 50]) == 4


def test_fail_quarantines_the_uncommitted_tail_only() -> None:
    m = mgr()
    prompt = list(range(10))
    prefill(m, 1, prompt, 16, job=1)  # committed 10: blocks 0,1 full; block 2 partial
    table = m.block_table(1)
    m.begin_update(1, 2, 11)
    m.fail(1, 2)
    seq = m.sequence(1)
    assert seq.state is S.UNKNOWN and seq.committed_len == 10
    assert sorted(m.pool.quarantined()) == sorted(table[2:])
    assert set(seq.blocks) == set(table[2:])
    # committed full blocks stay cached and are reusable by others
    assert m.reserve(2, 1, prompt, 12, K) == 8
    assert set(m.block_table(2)).isdisjoint(table[2:])
    with pytest.raises(KvStateError):
        m.block_table(1)
    with pytest.raises(KvStateError):
        m.begin_update(1, 3, 11)


def test_unknown_blocks_are_not_reused_until_recovery() -> None:
    m = mgr(num_blocks=4)
    m.reserve(1, 1, [1, 2, 3], 16, None)
    bad = set(m.block_table(1))
    m.begin_update(1, 1, 3)
    m.fail(1, 1)
    m.release(1)  # the entry goes, the blocks stay quarantined
    assert 1 not in m and set(m.pool.quarantined()) == bad
    assert m.available_blocks() == 0
    with pytest.raises(OutOfBlocks):
        m.reserve(2, 1, [1], 1, None)
    assert m.recover_chip() == []
    assert m.available_blocks() == 4 and m.stats()["blocks"]["quarantined"] == 0


def test_release_of_in_flight_sequence_quarantines_its_tail() -> None:
    m = mgr()
    m.reserve(1, 1, [1, 2, 3, 4, 5], 8, None)
    table = m.block_table(1)
    m.begin_update(1, 1, 5)
    m.release(1)
    assert 1 not in m
    assert sorted(m.pool.quarantined()) == sorted(table)
    assert m.stats()["released_in_flight"] == 1
    with pytest.raises(StaleJob):
        m.commit(1, 1, [1, 2, 3, 4, 5])  # the late completion is stale


def test_release_is_idempotent() -> None:
    m = mgr()
    m.reserve(1, 1, [1, 2, 3], 8, None)
    m.release(1)
    free = m.pool.num_free()
    m.release(1)
    m.release(12345)
    assert m.pool.num_free() == free == 16


def test_reserve_rejects_duplicates_and_bad_lengths() -> None:
    m = mgr(max_seq=16)
    m.reserve(1, 1, [1], 4, None)
    with pytest.raises(KvStateError):
        m.reserve(1, 1, [1], 4, None)
    with pytest.raises(ValueError):
        m.reserve(2, 1, [], 4, None)
    with pytest.raises(ValueError):
        m.reserve(2, 1, [1, 2, 3], 2, None)
    with pytest.raises(ValueError):
        m.reserve(2, 1, [1], 17, None)


def test_chip_fault_then_recover() -> None:
    m = mgr()
    prefill(m, 1, list(range(10)), 12, job=1)
    m.reserve(2, 1, list(range(10)), 12, K)
    m.begin_update(2, 9, 10)
    m.reserve(3, 1, [5, 6], 4, None)
    assert m.chip_fault() == [1, 2, 3]
    assert all(m.state(s) is S.UNKNOWN for s in (1, 2, 3))
    st = m.stats()
    assert st["blocks"]["cached"] == 0 and st["blocks"]["free"] + st["blocks"]["quarantined"] == 16
    assert m.available_blocks() == 0
    with pytest.raises(OutOfBlocks):
        m.reserve(4, 1, [1], 1, None)
    with pytest.raises(KvStateError):
        m.grow(1, 20)
    m.fail(2, 9)  # the job's late failure after the fault is absorbed
    with pytest.raises(StaleJob):
        m.commit(2, 9, list(range(10)))
    assert m.recover_chip() == [1, 2, 3]
    assert m.seq_ids() == [] and m.pool.num_free() == 16
    assert m.reserve(4, 1, list(range(10)), 12, K) == 0  # the cache was emptied


def test_recover_without_fault_drops_live_sequences_too() -> None:
    m = mgr()
    m.reserve(1, 1, [1, 2], 4, None)
    assert m.recover_chip() == [1]
    assert m.pool.num_free() == 16


def test_drop_generation_frees_unreferenced_cached_blocks() -> None:
    m = mgr()
    prefill(m, 1, list(range(9)), 9, job=1, key=PrefixKey(1))
    prefill(m, 2, list(range(9)), 9, job=2, key=PrefixKey(2))
    m.release(1)
    assert m.drop_generation(1) == 2
    assert m.stats()["blocks"]["cached"] == 2  # generation 2 untouched
    assert m.pool.num_free() == 16 - 3


def test_concurrent_duplicate_prefix_keeps_first_and_stays_consistent() -> None:
    m = mgr()
    prompt = list(range(12))
    m.reserve(1, 1, prompt, 16, K)
    m.reserve(2, 1, prompt, 16, K)  # both miss: computed twice
    for seq, job in ((1, 1), (2, 2)):
        m.begin_update(seq, job, 12)
    m.commit(1, 1, prompt)
    m.commit(2, 2, prompt)
    t1, t2 = m.block_table(1), m.block_table(2)
    assert all(m.cache.is_cached(b) for b in t1[:3])
    assert not any(m.cache.is_cached(b) for b in t2)
    m.begin_update(2, 3, 16)
    m.commit(2, 3, prompt + [1, 2, 3, 4])  # seq 2 keeps not feeding the cache below foreign blocks
    assert not m.cache.is_cached(t2[3])
    m.release(1)
    m.release(2)
    assert m.available_blocks() == 16


def test_commit_reads_only_the_committed_prefix_of_a_longer_token_list() -> None:
    m = mgr()
    tokens = list(range(12))  # the scheduler passes all it holds, never a copy
    m.reserve(1, 1, tokens, 12, K)
    m.begin_update(1, 1, 6)
    m.commit(1, 1, tokens)
    assert m.sequence(1).committed_len == 6
    assert m.stats()["blocks"]["cached"] == 1  # only the block below committed_len
    assert m.cached_prefix_len(K, tokens) == 4


def test_growing_sequence_caches_each_block_as_it_fills() -> None:
    m = mgr(max_seq=32)
    tokens = list(range(100, 103))
    m.reserve(1, 1, tokens, 3, K)
    m.begin_update(1, 1, 3)
    m.commit(1, 1, tokens)
    for job in range(2, 20):  # one decode step per job
        n = len(tokens)
        assert m.grow(1, min(32, -(-(n + 1) // BS) * BS))
        tokens.append(200 + job)
        m.begin_update(1, job, n + 1)
        m.commit(1, job, tokens)
        full = (n + 1) // BS
        assert m.stats()["blocks"]["cached"] == full
        assert m.cache.lookup(K, tokens) == m.block_table(1)[:full]


def test_dropped_cache_path_is_rebuilt_from_the_root_on_the_next_full_block() -> None:
    m = mgr()
    prompt = list(range(8))
    m.reserve(1, 1, prompt, 12, K)
    m.begin_update(1, 1, 8)
    m.commit(1, 1, prompt)
    assert m.stats()["blocks"]["cached"] == 2
    m.drop_generation(1)  # the live sequence's cached path disappears under it
    assert m.stats()["blocks"]["cached"] == 0
    tokens = prompt + [8, 9, 10, 11]
    m.begin_update(1, 2, 12)
    m.commit(1, 2, tokens)
    assert m.cache.lookup(K, tokens) == m.block_table(1)[:3]
    m.release(1)
    assert m.available_blocks() == 16


def test_per_token_kv_calls_skip_the_full_sweep_unless_paranoid(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_invariants() is O(blocks): a normal manager must not run it on begin_update/commit."""
    calls = {"n": 0}
    real = KvManager.check_invariants

    def counting(self: KvManager) -> None:
        calls["n"] += 1
        real(self)

    monkeypatch.setattr(KvManager, "check_invariants", counting)
    for paranoid, expect_sweeps in ((False, False), (True, True)):
        m = KvManager(chip=0, num_blocks=16, block_size=BS, max_seq=64, prefix_cache=True, paranoid=paranoid)
        m.reserve(1, 1, [1, 2, 3], 8, K)
        calls["n"] = 0
        for job, n in enumerate(range(3, 8), start=1):
            m.begin_update(1, job, n + 1)
            m.commit(1, job, list(range(8)))
        assert (calls["n"] > 0) is expect_sweeps


# -- tail rollback (discarded queued steps, rejected draft tokens) --------------------------------------------


def test_commit_upto_keeps_only_the_accepted_prefix_of_a_job() -> None:
    m = mgr()
    prefill(m, 1, list(range(6)), 12, job=1)
    m.begin_update(1, 2, 10)  # a 4-token chunk: positions 6..9
    m.commit(1, 2, list(range(10)), upto=8)
    seq = m.sequence(1)
    assert (seq.state, seq.committed_len, seq.pending_len) == (S.ACTIVE, 8, None)
    assert m.stats()["blocks"]["cached"] == 2  # blocks 0-1 full at 8: cached; nothing past upto
    m.begin_update(1, 3, 9)
    with pytest.raises(ValueError):
        m.commit(1, 3, list(range(9)), upto=8)  # must keep at least one new token
    assert m.state(1) is S.UPDATING


def test_rollback_tail_frees_the_blocks_past_the_kept_length() -> None:
    m = mgr()
    prefill(m, 1, list(range(6)), 7, job=1)  # blocks: 2 (7 tokens)
    assert m.grow(1, 16)  # a queued step / draft chunk reserved up to 16: 4 blocks
    table = m.block_table(1)
    m.take_freed()
    dropped = m.rollback_tail(1, 7)
    seq = m.sequence(1)
    assert (seq.committed_len, seq.reserved_len) == (6, 7)
    assert dropped == table[2:] and m.block_table(1) == table[:2]
    assert m.take_freed() == table[2:]  # announced: a backend with its own KV frees them too
    assert m.available_blocks() == 16 - 2
    # rolling back committed tokens too (rejected drafts already committed): committed_len follows
    m.begin_update(1, 2, 7)
    m.commit(1, 2, list(range(7)))
    assert m.rollback_tail(1, 5) == [] and m.sequence(1).committed_len == 5
    m.release(1)
    m.check_invariants()


def test_rollback_tail_refuses_cached_blocks_and_lanes_in_flight() -> None:
    m = mgr()
    prefill(m, 1, list(range(9)), 12, job=1)  # blocks 0-1 full and offered to the cache
    with pytest.raises(ValueError):
        m.rollback_tail(1, 7)
    m.begin_update(1, 2, 10)
    with pytest.raises(KvStateError):
        m.rollback_tail(1, 9)  # a job may still write: fail() or its commit first
    m.commit(1, 2, list(range(10)))
    table = m.block_table(1)
    assert m.rollback_tail(1, 8) == table[2:] and m.sequence(1).reserved_len == 8  # down to the cached blocks
    assert m.grow(1, 16) and len(m.block_table(1)) == 4  # the lane grows again from there


# -- the queued next step ----------------------------------------------------------------------------------


def test_queued_next_step_takes_the_lane_when_its_predecessor_commits() -> None:
    m = mgr()
    prefill(m, 1, list(range(6)), 8, job=1)
    m.begin_update(1, 2, 7)  # step N writes position 6
    m.queue_next_step(1, 3, 8)  # step N+1, queued while N runs, writes position 7
    with pytest.raises(KvStateError):
        m.queue_next_step(1, 4, 8)  # one queued step at a time
    with pytest.raises(StaleJob):
        m.commit(1, 3, list(range(8)))  # N+1 cannot complete before N
    m.commit(1, 2, list(range(7)))
    seq = m.sequence(1)
    assert (seq.state, seq.committed_len, seq.pending_job, seq.pending_len, seq.next_job) == (S.UPDATING, 7, 3, 8, None)
    m.commit(1, 3, list(range(8)))
    assert (m.state(1), m.sequence(1).committed_len) == (S.ACTIVE, 8)


def test_a_queued_step_past_the_lane_end_is_abandoned_and_its_block_given_back() -> None:
    m = mgr()
    prefill(m, 1, list(range(7)), 8, job=1)  # 2 blocks
    m.begin_update(1, 2, 8)  # N writes position 7: fills block 1
    assert m.grow(1, 9)  # N+1 writes position 8: a third block
    m.queue_next_step(1, 3, 9)
    m.commit(1, 2, list(range(8)))  # N sampled EOS: N+1 is past the end
    m.take_freed()
    third = m.block_table(1)[2]
    m.abandon(1, 3)  # N+1's result: nothing kept
    assert (m.state(1), m.sequence(1).committed_len) == (S.ACTIVE, 8)
    assert m.rollback_tail(1, 8) == [third] and m.take_freed() == [third]
    m.release(1)
    m.check_invariants()


def test_a_failed_queued_step_or_predecessor_makes_the_lane_unknown() -> None:
    for failed in (2, 3):
        m = mgr()
        prefill(m, 1, list(range(6)), 8, job=1)
        m.begin_update(1, 2, 7)
        m.queue_next_step(1, 3, 8)
        m.fail(1, failed)
        assert m.state(1) is S.UNKNOWN
        m.fail(1, 5 - failed)  # the other job's late failure changes nothing
        m.release(1)
        assert m.stats()["blocks"]["quarantined"] == 1  # the block holding positions 4.. (both jobs' writes)
        m.recover_chip()
        assert m.available_blocks() == 16
