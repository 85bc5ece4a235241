"""KvManager tail rollback: partial commit (accepted drafts only) and rollback_tail (blocks past the tail given back)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from engine.core.kv import KvManager, KvSequenceState as S, KvStateError, PrefixKey

BS = 4
K = PrefixKey(1)


def mgr(num_blocks: int = 16, max_seq: int = 64) -> KvManager:
    return KvManager(chip=0, num_blocks=num_blocks, block_size=BS, max_seq=max_seq, paranoid=True)


def test_partial_commit_counts_only_the_accepted_prefix() -> None:
    m = mgr()
    m.reserve(1, 1, [1, 2, 3], 8, None)
    m.begin_update(1, 1, 3)
    m.commit(1, 1, [1, 2, 3])
    m.begin_update(1, 2, 8)  # last token + 4 drafts
    m.commit(1, 2, [1, 2, 3, 9, 9], upto=5)
    seq = m.sequence(1)
    assert (seq.state, seq.committed_len, seq.reserved_len) == (S.ACTIVE, 5, 8)
    with pytest.raises(ValueError, match=r"need committed_len=5 < new_len=5 <= reserved_len=8"):
        m.begin_update(1, 3, 5)  # an update must grow past committed
    assert m.state(1) is S.ACTIVE  # refused: nothing changed
    m.begin_update(1, 3, 6)
    with pytest.raises(ValueError, match=r"commit upto=5 outside \(5, 6\]"):
        m.commit(1, 3, [0] * 8, upto=5)  # a partial commit must grow past committed too
    seq = m.sequence(1)
    assert (seq.state, seq.committed_len, seq.pending_len) == (S.UPDATING, 5, 6)  # refused: nothing changed


def test_partial_commit_bounds() -> None:
    m = mgr()
    m.reserve(1, 1, [1, 2, 3], 8, None)
    m.begin_update(1, 1, 3)
    with pytest.raises(ValueError):
        m.commit(1, 1, [1, 2, 3], upto=4)
    assert m.state(1) is S.UPDATING  # refused: nothing changed
    m.commit(1, 1, [1, 2, 3], upto=3)


def test_rollback_tail_gives_back_whole_tail_blocks_and_announces_them() -> None:
    m = mgr()
    m.reserve(1, 1, [1, 2, 3], 16, None)  # 4 blocks
    m.begin_update(1, 1, 3)
    m.commit(1, 1, [1, 2, 3])
    m.take_freed()
    tail = m.rollback_tail(1, 5)
    assert len(tail) == 2 and m.take_freed() == tail
    seq = m.sequence(1)
    assert (seq.committed_len, seq.reserved_len, len(seq.blocks)) == (3, 5, 2)
    assert m.rollback_tail(1, 9) == []  # past the reservation: nothing to do
    assert len(m.rollback_tail(1, 2)) == 1 and m.sequence(1).committed_len == 2  # rolls committed back too
    m.release(1)
    assert m.available_blocks() == 16


def test_rollback_tail_refuses_in_flight_and_cached_blocks() -> None:
    m = mgr()
    prompt = list(range(9))
    m.reserve(1, 1, prompt, 16, K)
    m.begin_update(1, 1, 9)
    with pytest.raises(KvStateError):
        m.rollback_tail(1, 9)
    m.commit(1, 1, prompt)  # two full blocks go to the prefix cache
    with pytest.raises(ValueError):
        m.rollback_tail(1, 7)
    m.rollback_tail(1, 9)
    m.release(1)
    m.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=25),
       st.integers(1, 9), st.booleans())
def test_speculative_steps_return_kv_accounting_to_baseline(steps, prompt_len, cached) -> None:
    """Any accept/reject sequence against a plain model: blocks held = ceil(reserved / BS); all back at the end."""
    m = mgr(num_blocks=32, max_seq=128)
    key = K if cached else None
    baseline = m.available_blocks()
    tokens = list(range(prompt_len))
    m.reserve(1, 1, tokens, prompt_len, key)
    m.begin_update(1, 1, prompt_len)
    m.commit(1, 1, tokens)
    job = 1
    for k, accept in steps:
        accept = min(accept, k)
        committed = m.sequence(1).committed_len
        want = committed + 1 + k  # last token + k drafts
        if want > 128:
            break
        assert m.grow(1, want)
        job += 1
        m.begin_update(1, job, want)
        tokens = tokens[:committed] + [7] * (1 + accept) + [8] * 8
        m.commit(1, job, tokens, upto=committed + 1 + accept)
        m.rollback_tail(1, committed + 2 + accept)  # room for the correction token only
        seq = m.sequence(1)
        # the plain model: the table holds exactly the reserved tokens' blocks, the pool the rest
        assert seq.committed_len == committed + 1 + accept
        assert len(seq.blocks) == -(-seq.reserved_len // BS)
        assert m.available_blocks() == baseline - len(seq.blocks)
    m.release(1)
    assert m.available_blocks() == baseline
    m.check_invariants()
