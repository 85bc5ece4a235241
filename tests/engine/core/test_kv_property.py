"""Stateful property test of KvManager against a plain reference model.

The reference keeps only dicts and sets: each sequence's state, lengths and
the block table it was handed, the tokens each committed full block holds,
and the blocks a failure quarantined. From those alone it predicts capacity,
stale completions and what may be shared, and checks after every step: lane
uniqueness, length bounds, ref counts, block conservation, reclaim of
terminal resources, and that quarantined (Unknown) blocks are never handed
out again before recovery.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.kv import KvManager, KvSequenceState as S, KvStateError, OutOfBlocks, PrefixKey, StaleJob

BS = 4
NUM_BLOCKS = 20
MAX_SEQ = 32
BASES = [[(i * 7 + b) % 3 for i in range(MAX_SEQ)] for b in range(2)]  # shared prompt stems
KEYS = [PrefixKey(1), PrefixKey(1), PrefixKey(1), PrefixKey(2), PrefixKey(1, "t"), None]
NEVER_ISSUED_JOB = -1


def ceil_blocks(n: int) -> int:
    return -(-n // BS)


@dataclass
class RefSeq:
    state: S
    key: PrefixKey | None
    tokens: list[int]
    committed: int
    reserved: int
    cached: int
    table: list[int]
    job: int | None = None  # last job issued
    pending_len: int | None = None
    lost_job: int | None = None  # in flight when the sequence became Unknown


@dataclass
class Ref:
    seqs: dict[int, RefSeq] = field(default_factory=dict)
    content: dict[int, tuple[PrefixKey | None, tuple[int, ...]]] = field(default_factory=dict)
    quarantine: set[int] = field(default_factory=set)
    faulted: bool = False

    def live(self) -> list[int]:
        return sorted(s for s, q in self.seqs.items() if q.state in (S.RESERVED, S.ACTIVE, S.UPDATING))

    def held(self) -> set[int]:
        return {b for s in self.live() for b in self.seqs[s].table}

    def available(self) -> int:
        return 0 if self.faulted else NUM_BLOCKS - len(self.held()) - len(self.quarantine)


class KvMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KvManager(chip=0, num_blocks=NUM_BLOCKS, block_size=BS, max_seq=MAX_SEQ, paranoid=True)
        self.ref = Ref()
        self.next_seq = 0
        self.next_job = 0

    def has(self, *states: S) -> bool:
        return any(q.state in states for q in self.ref.seqs.values())

    def pick(self, idx: int, states: tuple[S, ...]) -> int | None:
        cands = sorted(s for s, q in self.ref.seqs.items() if q.state in states)
        return cands[idx % len(cands)] if cands else None

    def _take_fresh(self, blocks: list[int]) -> None:
        held_elsewhere = self.ref.held()
        for b in blocks:
            assert b not in self.ref.quarantine, f"quarantined block {b} handed out"
            assert b not in held_elsewhere, f"block {b} handed out while in use"
            self.ref.content.pop(b, None)

    def expect_stale(self, sid: int, job: int) -> None:
        before = (self.m.stats(), self.m.sequence(sid).committed_len)
        with pytest.raises(StaleJob):
            self.m.commit(sid, job, list(range(MAX_SEQ)))
        with pytest.raises(StaleJob):
            self.m.fail(sid, job)
        assert (self.m.stats(), self.m.sequence(sid).committed_len) == before

    # -- rules -----------------------------------------------------------------
    @rule(
        base=st.integers(0, len(BASES) - 1),
        stem=st.sampled_from([0, 3, 4, 5, 8, 9, 12, 16, 20]),
        tail=st.lists(st.integers(0, 2), max_size=4),
        extra=st.integers(0, 10),
        key_i=st.integers(0, len(KEYS) - 1),
    )
    def reserve(self, base: int, stem: int, tail: list[int], extra: int, key_i: int) -> None:
        prompt = (BASES[base][:stem] + tail)[:MAX_SEQ] or [1]
        reserve_len = min(len(prompt) + extra, MAX_SEQ)
        key = KEYS[key_i]
        sid = self.next_seq
        self.next_seq += 1
        need_all = ceil_blocks(reserve_len)
        avail = self.ref.available()
        max_match = (len(prompt) - 1) // BS if key is not None else 0
        before = self.m.stats()
        try:
            cached = self.m.reserve(sid, key_i, prompt, reserve_len, key)
        except OutOfBlocks:
            assert self.ref.faulted or need_all > avail, "reserve refused although enough blocks were free"
            assert self.m.stats() == before, "failed reserve left a trace"
            assert sid not in self.m
            return
        assert not self.ref.faulted, "reserve succeeded on a faulted chip"
        assert need_all <= avail + max_match, "reserve succeeded beyond capacity"
        assert cached % BS == 0 and cached <= max_match * BS
        table = self.m.block_table(sid)
        m = cached // BS
        held = self.ref.held()
        revived = 0
        for i, b in enumerate(table[:m]):
            assert b not in self.ref.quarantine, "matched a quarantined block"
            assert self.ref.content.get(b) == (key, tuple(prompt[: (i + 1) * BS])), "prefix hit with wrong content/key"
            revived += b not in held
        assert need_all - m <= avail - revived
        self._take_fresh(table[m:])
        self.ref.seqs[sid] = RefSeq(S.RESERVED, key, list(prompt), cached, reserve_len, cached, table)

    @precondition(lambda self: self.has(S.RESERVED, S.ACTIVE, S.UPDATING))
    @rule(idx=st.integers(0, 99), delta=st.integers(1, 12))
    def grow(self, idx: int, delta: int) -> None:
        sid = self.pick(idx, (S.RESERVED, S.ACTIVE, S.UPDATING))
        if sid is None:
            return
        q = self.ref.seqs[sid]
        new = min(q.reserved + delta, MAX_SEQ)
        need = ceil_blocks(new) - len(q.table)
        ok = self.m.grow(sid, new)
        assert ok == (need <= self.ref.available())
        if ok:
            table = self.m.block_table(sid)
            assert table[: len(q.table)] == q.table
            self._take_fresh(table[len(q.table) :])
            q.table, q.reserved = table, new

    @precondition(lambda self: self.has(S.RESERVED, S.ACTIVE))
    @rule(
        idx=st.integers(0, 99),
        n=st.integers(1, 24),
        gen=st.integers(0, 2**18),
        outcome=st.sampled_from(["commit", "commit", "commit", "fail", "in_flight"]),
    )
    def begin_update(self, idx: int, n: int, gen: int, outcome: str) -> None:
        sid = self.pick(idx, (S.RESERVED, S.ACTIVE))
        if sid is None:
            return
        q = self.ref.seqs[sid]
        if q.committed >= q.reserved:
            with pytest.raises(ValueError):
                self.m.begin_update(sid, self.next_job, q.committed + 1)
            return
        new_len = min(q.committed + n, q.reserved)
        self.next_job += 1
        self.m.begin_update(sid, self.next_job, new_len)
        while len(q.tokens) < new_len:
            q.tokens.append((gen >> (len(q.tokens) % 16)) % 3)
        q.state, q.job, q.pending_len = S.UPDATING, self.next_job, new_len
        if outcome == "commit":
            self._commit(sid, dup=False)
        elif outcome == "fail":
            self._fail(sid)

    @precondition(lambda self: self.has(S.RESERVED, S.ACTIVE))
    @rule(idx=st.integers(0, 99), n=st.integers(1, 4), gen=st.integers(0, 2**18),
          outcome=st.sampled_from(["both", "abandon_next", "abandon_both", "fail_first", "fail_next"]))
    def queued_step(self, idx: int, n: int, gen: int, outcome: str) -> None:
        """Step N and its queued step N+1: N+1 takes the lane at N's commit, or either discarded/failed."""
        sid = self.pick(idx, (S.RESERVED, S.ACTIVE))
        if sid is None:
            return
        q = self.ref.seqs[sid]
        if q.committed + 1 >= q.reserved:
            return
        first = min(q.committed + n, q.reserved - 1)
        second = first + 1
        j1, j2 = self.next_job + 1, self.next_job + 2
        self.next_job += 2
        self.m.begin_update(sid, j1, first)
        self.m.queue_next_step(sid, j2, second)
        with pytest.raises(KvStateError):
            self.m.queue_next_step(sid, j2 + 1, second)
        while len(q.tokens) < second:
            q.tokens.append((gen >> (len(q.tokens) % 16)) % 3)
        q.state, q.job, q.pending_len = S.UPDATING, j1, first
        if outcome in ("fail_first", "fail_next"):
            q.job = j1 if outcome == "fail_first" else j2
            self._fail(sid)
            return
        if outcome == "abandon_both":
            self.m.abandon(sid, j1)  # N's writes not kept either: N+1 takes the lane, then is abandoned
            self.m.abandon(sid, j2)
            q.state, q.pending_len = S.ACTIVE, None
            return
        self._commit(sid, dup=False)  # N: the queued step is now the pending one
        assert self.m.state(sid) is S.UPDATING and self.m.sequence(sid).pending_job == j2
        q.state, q.job, q.pending_len = S.UPDATING, j2, second
        if outcome == "both":
            self._commit(sid, dup=False)
        else:
            self.m.abandon(sid, j2)
            q.state, q.pending_len = S.ACTIVE, None

    @precondition(lambda self: self.has(S.RESERVED, S.ACTIVE))
    @rule(idx=st.integers(0, 99), back=st.integers(0, 12))
    def rollback_tail(self, idx: int, back: int) -> None:
        sid = self.pick(idx, (S.RESERVED, S.ACTIVE))
        if sid is None:
            return
        q = self.ref.seqs[sid]
        floor = max(q.cached, self.m.sequence(sid).cache_blocks * BS)
        n = max(q.reserved - back, floor)
        if n < floor or n < 1:
            return
        dropped = self.m.rollback_tail(sid, n)
        q.committed, q.reserved = min(q.committed, n), min(q.reserved, n)
        keep = ceil_blocks(q.reserved)
        assert dropped == q.table[keep:]
        for b in q.table[q.committed // BS:]:  # past the new committed end: not this lane's content (unless cached)
            if not self.m.cache.is_cached(b):
                self.ref.content.pop(b, None)
        q.table = q.table[:keep]
        del q.tokens[q.committed:]

    @precondition(lambda self: self.has(S.UPDATING))
    @rule(idx=st.integers(0, 99), dup=st.booleans())
    def commit(self, idx: int, dup: bool) -> None:
        self._commit(self.pick(idx, (S.UPDATING,)), dup)

    def _commit(self, sid: int | None, dup: bool) -> None:
        if sid is None:
            return
        q = self.ref.seqs[sid]
        assert q.pending_len is not None
        if dup:
            self.expect_stale(sid, NEVER_ISSUED_JOB)
        self.m.commit(sid, q.job, q.tokens[: q.pending_len])
        if dup:
            self.expect_stale(sid, q.job)  # a duplicated completion
        q.state, q.committed, q.pending_len = S.ACTIVE, q.pending_len, None
        for i in range(q.committed // BS):
            record = (q.key, tuple(q.tokens[: (i + 1) * BS]))
            old = self.ref.content.setdefault(q.table[i], record)
            assert old == record, "a shared block would hold two different contents"

    @precondition(lambda self: self.has(S.UPDATING))
    @rule(idx=st.integers(0, 99))
    def fail(self, idx: int) -> None:
        self._fail(self.pick(idx, (S.UPDATING,)))

    def _fail(self, sid: int | None) -> None:
        if sid is None:
            return
        q = self.ref.seqs[sid]
        self.m.fail(sid, q.job)
        self._to_unknown(sid)
        assert self.m.sequence(sid).blocks == q.table

    def _to_unknown(self, sid: int) -> None:
        q = self.ref.seqs[sid]
        tail = q.table[q.committed // BS :]
        self.ref.quarantine |= set(tail)
        for b in tail:
            self.ref.content.pop(b, None)
        q.state, q.table, q.pending_len, q.lost_job = S.UNKNOWN, tail, None, q.job

    @precondition(lambda self: self.has(S.UNKNOWN))
    @rule(idx=st.integers(0, 99))
    def late_fail_after_fault(self, idx: int) -> None:
        sid = self.pick(idx, (S.UNKNOWN,))
        if sid is None:
            return
        q = self.ref.seqs[sid]
        if q.lost_job is None:
            with pytest.raises(StaleJob):
                self.m.fail(sid, NEVER_ISSUED_JOB)
            return
        before = self.m.stats()
        self.m.fail(sid, q.lost_job)  # the timed-out job of a sequence already made Unknown: absorbed
        assert self.m.stats() == before and self.m.state(sid) is S.UNKNOWN

    @precondition(lambda self: bool(self.ref.seqs))
    @rule(idx=st.integers(0, 99))
    def release(self, idx: int) -> None:
        sid = self.pick(idx, tuple(S))
        if sid is None:
            return
        q = self.ref.seqs[sid]
        if q.state is S.UPDATING:
            self._to_unknown(sid)
        self.m.release(sid)
        del self.ref.seqs[sid]
        assert sid not in self.m
        self.m.release(sid)  # idempotent

    @precondition(lambda self: len(self.ref.seqs) > 2)
    @rule()
    def release_all(self) -> None:
        for sid in list(self.ref.seqs):
            if self.ref.seqs[sid].state is S.UPDATING:
                self._to_unknown(sid)
            self.m.release(sid)
            del self.ref.seqs[sid]
        st_ = self.m.stats()["blocks"]
        assert st_["used"] == 0, "terminal sequences still hold blocks"
        if not self.ref.faulted:
            assert st_["quarantined"] == len(self.ref.quarantine)
            assert st_["free"] + st_["evictable"] == NUM_BLOCKS - len(self.ref.quarantine)

    @precondition(lambda self: not self.ref.faulted and len(self.ref.seqs) > 1)
    @rule(now=st.integers(0, 3))
    def chip_fault(self, now: int) -> None:
        if now:  # faults are rarer than the other events
            return
        assert self.m.chip_fault() == sorted(self.ref.seqs)
        self.ref.quarantine |= self.ref.held()
        for q in self.ref.seqs.values():
            if q.state is S.UPDATING:
                q.lost_job = q.job
            q.state, q.pending_len = S.UNKNOWN, None
        self.ref.content.clear()
        self.ref.faulted = True
        for sid in self.ref.seqs:
            with pytest.raises(KvStateError):
                self.m.block_table(sid)

    @precondition(lambda self: self.ref.faulted)
    @rule()
    def recover(self) -> None:
        assert self.m.recover_chip() == sorted(self.ref.seqs)
        self.ref = Ref()
        assert self.m.available_blocks() == NUM_BLOCKS == self.m.pool.num_free()

    # -- invariants ------------------------------------------------------------
    @invariant()
    def matches_reference(self) -> None:
        m, ref = self.m, self.ref
        m.check_invariants()
        assert set(m.seq_ids()) == set(ref.seqs)
        for sid, q in ref.seqs.items():
            seq = m.sequence(sid)
            assert (seq.state, seq.committed_len, seq.reserved_len, seq.cached_len) == (
                q.state, q.committed, q.reserved, q.cached,
            )
            assert q.cached <= q.committed <= q.reserved <= MAX_SEQ
            if q.state is S.UNKNOWN:
                assert set(seq.blocks) <= m.pool.quarantined()
                continue
            assert m.block_table(sid) == q.table and len(q.table) == ceil_blocks(q.reserved)
            assert set(q.table).isdisjoint(ref.quarantine), "an Unknown block is in use"

    @invariant()
    def lanes_unique_and_conserved(self) -> None:
        m, ref = self.m, self.ref
        owners: dict[int, list[tuple[int, int]]] = {}
        for sid in ref.live():
            for i, b in enumerate(ref.seqs[sid].table):
                owners.setdefault(b, []).append((sid, i))
        for b, uses in owners.items():
            assert m.pool.refcount(b) == len(uses)
            if len(uses) > 1:  # sharing only of a full committed prefix block, same position
                assert len({i for _, i in uses}) == 1 and b in ref.content
                assert all(ref.seqs[s].committed >= (i + 1) * BS for s, i in uses)
        blocks = m.stats()["blocks"]
        assert blocks["used"] == len(owners)
        assert blocks["free"] + blocks["quarantined"] + blocks["evictable"] + blocks["used"] == NUM_BLOCKS
        assert ref.quarantine <= m.pool.quarantined()
        if not ref.faulted:
            assert blocks["quarantined"] == len(ref.quarantine)
        assert m.available_blocks() == ref.available()


KvMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKvMachine = KvMachine.TestCase
