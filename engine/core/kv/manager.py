"""KvManager: the KV lanes of one chip (docs/architecture.md, "KV manager and prefix cache").

Owns the chip's `BlockPool` and `PrefixCache` and one `KvSequence` per live
seq_id. Every transition is checked against `states.LEGAL_TRANSITIONS`, and
committed_len only grows in `commit()`, i.e. after the device and the output
both succeeded.

Failure rules (why they are safe):
* `fail()`: only blocks at or after the block holding `committed_len` can be
  written by the failed (maybe still running) job, and those are never in the
  prefix cache (a cached block is full and committed). They are quarantined;
  the fully committed blocks before them are released normally.
* `chip_fault()`: device memory is gone or suspect, so every held block is
  quarantined and the prefix cache is emptied; nothing is handed out until
  `recover_chip()`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.kv.block_pool import BlockPool, OutOfBlocks
from engine.core.kv.prefix_cache import PrefixCache, PrefixKey
from engine.core.kv.states import KvSequenceState, KvStateError, check_transition

S = KvSequenceState


class StaleJob(Exception):
    """A completion whose job id is not the sequence's pending job (or whose sequence is gone)."""


@dataclass
class KvSequence:
    seq_id: int
    state: KvSequenceState
    generation: int
    blocks: list[int]  # block table; for UNKNOWN: the blocks it left in quarantine
    committed_len: int  # tokens whose KV is valid (starts at cached_len)
    reserved_len: int  # tokens the block table can hold
    cached_len: int  # prompt tokens found in the prefix cache at reserve()
    pending_job: int | None
    pending_len: int | None = None  # new_len of the in-flight job
    key: PrefixKey | None = None  # None: this sequence neither reads nor feeds the prefix cache
    cache_blocks: int = 0  # leading blocks already offered to the prefix cache
    cache_stopped: bool = False  # insert hit a concurrent duplicate; stop feeding the cache
    cache_tail: int | None = None  # the block at position cache_blocks-1 (None when cache_blocks == 0)
    cache_epoch: int = -1  # PrefixCache.epoch when cache_tail was recorded; a mismatch means re-walk
    # A queued next step (executor.queue_next_step): a second job, submitted while
    # pending_job runs, that writes the positions after it. It becomes the pending job when pending_job commits.
    next_job: int | None = None
    next_len: int | None = None
    chain: list[bytes] | None = None  # chain hashes of its leading full blocks (KV tiers only, see tier_transfers)


_LIVE = (S.RESERVED, S.ACTIVE, S.UPDATING)
# The per-token transitions (begin_update, commit) start from states checked
# in place, so their legality is a property of the table: check it once here
# instead of on every token.
for _old, _new in ((S.RESERVED, S.UPDATING), (S.ACTIVE, S.UPDATING), (S.UPDATING, S.ACTIVE)):
    check_transition(_old, _new)


class KvManager:
    def __init__(
        self,
        chip: int,
        num_blocks: int,
        block_size: int,
        max_seq: int,
        prefix_cache: bool = True,
        *,
        paranoid: bool = False,
    ) -> None:
        """`paranoid=True` runs the full O(blocks) `check_invariants()` after every transition."""
        if max_seq <= 0:
            raise ValueError("max_seq must be positive")
        self.chip = chip
        self.block_size = block_size
        self.max_seq = max_seq
        self.prefix_cache_enabled = prefix_cache
        self.paranoid = paranoid
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = PrefixCache(block_size)
        self.faulted = False
        self._seqs: dict[int, KvSequence] = {}
        self.preempt_refusals = 0  # grow() calls refused for lack of blocks
        self.released_in_flight = 0  # release() of an UPDATING sequence (its tail got quarantined)
        self._freed: list[int] = []  # blocks back in the free pool since take_freed() (not cached, not quarantined)
        # None, or where blocks newly offered to the prefix cache are noted for the KV tiers (write-through):
        # (sequence, its tokens, first new block index, end index, the block ids of those positions)
        self.tier_sink: list[tuple] | None = None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # -- capacity --------------------------------------------------------------
    def available_blocks(self) -> int:
        if self.faulted:
            return 0
        return self.pool.num_free() + self.cache.evictable()

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    # -- lookup --------------------------------------------------------------
    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def sequence(self, seq_id: int) -> KvSequence:
        return self._seqs[seq_id]

    def state(self, seq_id: int) -> KvSequenceState:
        seq = self._seqs.get(seq_id)
        return S.FREE if seq is None else seq.state

    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.block_table_view(seq_id))

    def block_table_view(self, seq_id: int) -> Sequence[int]:
        """The live block table, not copied: read it before the next call into this manager.

        For the scheduler's job packing, which copies it into the job record at once.
        """
        seq = self._seqs[seq_id]
        if seq.state not in _LIVE:
            raise KvStateError(f"seq {seq_id} is {seq.state.name}: no usable block table")
        return seq.blocks

    def cached_prefix_len(self, key: PrefixKey, prompt: Sequence[int]) -> int:
        """Prompt tokens reserve() would find cached (side-effect free; for chip placement)."""
        if not self.prefix_cache_enabled or self.faulted or len(prompt) < 2:
            return 0
        return len(self.cache.lookup(key, prompt[: len(prompt) - 1])) * self.block_size

    # -- transitions -----------------------------------------------------------
    def reserve(
        self, seq_id: int, generation: int, prompt: Sequence[int], reserve_len: int, key: PrefixKey | None
    ) -> int:
        if seq_id in self._seqs:
            raise KvStateError(f"seq {seq_id} already {self._seqs[seq_id].state.name}")
        if not prompt:
            raise ValueError("empty prompt")
        if not len(prompt) <= reserve_len <= self.max_seq:
            raise ValueError(f"need len(prompt)={len(prompt)} <= reserve_len={reserve_len} <= max_seq={self.max_seq}")
        if self.faulted:
            raise OutOfBlocks(f"chip {self.chip} faulted, awaiting recovery")
        use_cache = self.prefix_cache_enabled and key is not None
        # At least one prompt token must be computed (it produces the first logits).
        probe = prompt[: len(prompt) - 1]
        matched = self.cache.lookup(key, probe) if use_cache else []
        revived = sum(1 for b in matched if self.pool.refcount(b) == 0)
        need = self.blocks_needed(reserve_len) - len(matched)
        assert need >= 0
        if need > self.pool.num_free() + self.cache.evictable() - revived:
            raise OutOfBlocks(f"seq {seq_id}: need {need} blocks, {self.available_blocks() - revived} available")
        if use_cache:
            assert self.cache.match(key, probe) == matched
        for b in matched:
            if self.pool.refcount(b) == 0:
                self.cache.mark_referenced(b)
            self.pool.incref(b)
        self._make_room(need)
        fresh = self.pool.allocate(need)
        cached_len = len(matched) * self.block_size
        check_transition(S.FREE, S.RESERVED)
        self._seqs[seq_id] = KvSequence(
            seq_id=seq_id,
            state=S.RESERVED,
            generation=generation,
            blocks=matched + fresh,
            committed_len=cached_len,
            reserved_len=reserve_len,
            cached_len=cached_len,
            pending_job=None,
            key=key if use_cache else None,
            cache_blocks=len(matched),
            cache_tail=matched[-1] if matched else None,
            cache_epoch=self.cache.epoch,
        )
        self._after(seq_id)
        return cached_len

    def grow(self, seq_id: int, new_reserved_len: int) -> bool:
        seq = self._live(seq_id)
        if new_reserved_len > self.max_seq:
            raise ValueError(f"new_reserved_len {new_reserved_len} > max_seq {self.max_seq}")
        if new_reserved_len <= seq.reserved_len:
            return True
        need = self.blocks_needed(new_reserved_len) - len(seq.blocks)
        if need > self.available_blocks():
            self.preempt_refusals += 1
            return False
        self._make_room(need)
        seq.blocks.extend(self.pool.allocate(need))
        seq.reserved_len = new_reserved_len
        self._after(seq_id)
        return True

    def begin_update(self, seq_id: int, job_id: int, new_len: int) -> None:
        seq = self._seqs.get(seq_id)
        if seq is None or (seq.state is not S.RESERVED and seq.state is not S.ACTIVE):
            raise KvStateError(f"begin_update on seq {seq_id} in state {self.state(seq_id).name}")
        if not seq.committed_len < new_len <= seq.reserved_len:
            raise ValueError(
                f"seq {seq_id}: need committed_len={seq.committed_len} < new_len={new_len} <= reserved_len={seq.reserved_len}"
            )
        seq.state = S.UPDATING  # legal from RESERVED / ACTIVE (checked at import)
        seq.pending_job = job_id
        seq.pending_len = new_len
        assert seq.committed_len <= seq.reserved_len <= self.max_seq, seq
        if self.paranoid:
            self.check_invariants()

    def queue_next_step(self, seq_id: int, job_id: int, new_len: int) -> None:
        """Hand the lane to a second job queued behind its pending one (the next decode step).

        The sequence stays UPDATING: when the pending job commits, `job_id`
        becomes the pending job with `new_len`. Lanes are owned by one job at
        a time except for a queued step, so at most one job may be queued.
        """
        seq = self._seqs.get(seq_id)
        if seq is None or seq.state is not S.UPDATING or seq.next_job is not None:
            raise KvStateError(f"queue_next_step on seq {seq_id} in state {self.state(seq_id).name}"
                               + ("" if seq is None or seq.next_job is None else f", job {seq.next_job} queued"))
        assert seq.pending_len is not None
        if not seq.pending_len < new_len <= seq.reserved_len:
            raise ValueError(f"seq {seq_id}: need pending_len={seq.pending_len} < new_len={new_len} "
                             f"<= reserved_len={seq.reserved_len}")
        seq.next_job = job_id
        seq.next_len = new_len
        self._after(seq_id)

    def abandon(self, seq_id: int, job_id: int) -> None:
        """The pending job finished and nothing it wrote is kept (a queued step past the lane's end).

        committed_len is unchanged: the positions it wrote lie past it, so the
        next job overwrites them, or `rollback_tail` / `release` gives their
        blocks back. A job queued behind it becomes the pending one (it may
        still be writing: the lane stays UPDATING until it drains too);
        otherwise the lane is ACTIVE.
        """
        seq = self._pending(seq_id, job_id)
        if seq.next_job is not None:
            seq.pending_job, seq.pending_len = seq.next_job, seq.next_len
            seq.next_job = seq.next_len = None
        else:
            seq.state = S.ACTIVE  # legal from UPDATING (checked at import)
            seq.pending_job = seq.pending_len = None
        self._after(seq_id)

    def commit(self, seq_id: int, job_id: int, tokens: Sequence[int], upto: int | None = None) -> None:
        """`tokens`: the sequence's tokens, at least its first pending_len (longer is fine; never copied).

        `upto` (committed_len < upto <= pending_len) commits only that many
        tokens: the job wrote further (a speculative chunk, a multi-step job
        that stopped early) but the positions past `upto` are not kept; the
        next job overwrites them, and they never reach the prefix cache.
        Runs once per sequence per job, so it stays O(1) except when a block
        fills, which costs O(new full blocks) in the prefix cache.
        """
        seq = self._seqs.get(seq_id)
        if seq is None or seq.state is not S.UPDATING or seq.pending_job != job_id:
            seq = self._pending(seq_id, job_id)  # raises StaleJob with the details
        new_len = seq.pending_len
        assert new_len is not None
        if upto is not None:
            if not seq.committed_len < upto <= new_len:
                raise ValueError(f"seq {seq_id}: commit upto={upto} outside ({seq.committed_len}, {new_len}]")
            new_len = upto
        if len(tokens) < new_len:
            raise ValueError(f"seq {seq_id}: commit of {new_len} tokens given only {len(tokens)}")
        seq.committed_len = new_len
        if seq.next_job is not None:  # the queued next step now owns the lane (it stays UPDATING)
            seq.pending_job, seq.pending_len = seq.next_job, seq.next_len
            seq.next_job = seq.next_len = None
        else:
            seq.state = S.ACTIVE  # legal from UPDATING (checked at import)
            seq.pending_job = None
            seq.pending_len = None
        if seq.key is not None and new_len // self.block_size > seq.cache_blocks:
            self._feed_cache(seq, tokens)
        assert seq.committed_len <= seq.reserved_len <= self.max_seq, seq
        if self.paranoid:
            self.check_invariants()

    def rollback_tail(self, seq_id: int, new_len: int) -> list[int]:
        """Roll a lane's KV back to its first `new_len` tokens and give back the blocks past them.

        For a lane between jobs (RESERVED / ACTIVE) whose last job wrote or
        reserved past where it ends: a discarded queued step, rejected draft
        tokens. committed_len becomes min(committed_len, new_len),
        reserved_len min(reserved_len, new_len), and the block table keeps
        only the blocks that length needs; the rest go back to the pool
        (announced by take_freed(), so a backend frees them too). Blocks
        already offered to the prefix cache are shared and immutable, so the
        tail may not reach into them (ValueError). Returns the blocks dropped.
        """
        seq = self._seqs.get(seq_id)
        if seq is None or (seq.state is not S.RESERVED and seq.state is not S.ACTIVE):
            raise KvStateError(f"rollback_tail on seq {seq_id} in state {self.state(seq_id).name}")
        floor = max(seq.cached_len, seq.cache_blocks * self.block_size)
        if not floor <= new_len:
            raise ValueError(f"seq {seq_id}: rollback to {new_len} below its cached prefix ({floor} tokens)")
        seq.committed_len = min(seq.committed_len, new_len)
        seq.reserved_len = min(seq.reserved_len, new_len)
        keep = self.blocks_needed(seq.reserved_len)
        dropped = seq.blocks[keep:]
        if dropped:
            del seq.blocks[keep:]
            self._drop_refs(dropped)
        self._after(seq_id)
        return dropped

    def fail(self, seq_id: int, job_id: int) -> None:
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.state is S.UNKNOWN and job_id in (seq.pending_job, seq.next_job):
            return  # already unknown through chip_fault() or its other job's failure: nothing changes
        # the queued step failing makes the lane Unknown as well: the job before it is in doubt too
        if seq is None or seq.state is not S.UPDATING or seq.next_job != job_id:
            seq = self._pending(seq_id, job_id)
        self._to_unknown(seq)
        self._after(seq_id)

    def abort_update(self, seq_id: int, job_id: int) -> None:
        """The pending job wrote nothing (a KV import the worker refused whole): back to ACTIVE, committed_len kept."""
        seq = self._pending(seq_id, job_id)
        seq.state = S.ACTIVE  # UPDATING -> ACTIVE is legal (checked at import)
        seq.pending_job = None
        seq.pending_len = None
        self._after(seq_id)

    def release(self, seq_id: int) -> None:
        """Idempotent. UNKNOWN: the entry goes, its blocks stay quarantined until recover_chip().

        UPDATING (a job still in flight, e.g. a deadline hit): treated as a
        failure first, so blocks the device may still write are quarantined.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            return
        if seq.state is S.UPDATING:
            self.released_in_flight += 1
            self._to_unknown(seq)
        if seq.state is S.UNKNOWN:
            check_transition(S.UNKNOWN, S.FREE)
            del self._seqs[seq_id]
            self._after(None)
            return
        check_transition(seq.state, S.RELEASING)
        seq.state = S.RELEASING
        self._drop_refs(seq.blocks)
        seq.blocks = []
        check_transition(S.RELEASING, S.FREE)
        del self._seqs[seq_id]
        self._after(None)

    def chip_fault(self) -> list[int]:
        """Every sequence -> UNKNOWN, every held block -> quarantine, prefix cache emptied."""
        self.faulted = True
        for seq in self._seqs.values():
            if seq.state is S.UNKNOWN:
                continue
            check_transition(seq.state, S.UNKNOWN)
            for b in seq.blocks:
                self.pool.decref(b)
            seq.state = S.UNKNOWN
            seq.pending_len = seq.next_len = None  # pending_job, next_job kept: their late fail() is recognised
        self.cache.clear()
        self.pool.quarantine(self.pool.held())
        self._after(None)
        return sorted(self._seqs)

    def recover_chip(self) -> list[int]:
        """After the worker restarted: drop all sequences, release quarantine, start with an empty cache.

        Implies chip_fault() when it was not called. Returns the dropped seq_ids.
        """
        self.chip_fault()
        dropped = sorted(self._seqs)
        for seq in self._seqs.values():
            check_transition(seq.state, S.FREE)
        self._seqs.clear()
        self.pool.release_quarantine()
        self._freed.clear()  # a restarted worker holds nothing
        self.faulted = False
        if self.pool.num_free() != self.pool.num_blocks:
            raise AssertionError("blocks leaked across chip recovery")
        self._after(None)
        return dropped

    def drop_generation(self, generation: int) -> int:
        """Forget cached prefixes of a retired model generation; returns blocks freed."""
        freed = 0
        for key in [k for k in self.cache.keys() if k.generation == generation]:
            for b in self.cache.drop_key(key):
                self.pool.free(b)
                self._freed.append(b)
                freed += 1
        self._after(None)
        return freed

    def take_freed(self) -> list[int]:
        """The blocks freed (to the pool, not to the prefix cache) since the last call, oldest first."""
        freed, self._freed = self._freed, []
        return freed

    # -- internals -------------------------------------------------------------
    def _live(self, seq_id: int) -> KvSequence:
        seq = self._seqs.get(seq_id)
        if seq is None or seq.state not in _LIVE:
            raise KvStateError(f"seq {seq_id} is {self.state(seq_id).name}")
        return seq

    def _pending(self, seq_id: int, job_id: int) -> KvSequence:
        seq = self._seqs.get(seq_id)
        if seq is None or seq.state is not S.UPDATING or seq.pending_job != job_id:
            state = self.state(seq_id).name
            pending = None if seq is None else seq.pending_job
            raise StaleJob(f"seq {seq_id} ({state}, pending job {pending}) got completion of job {job_id}")
        return seq

    def _make_room(self, n: int) -> None:
        short = n - self.pool.num_free()
        if short <= 0:
            return
        evicted = self.cache.evict(short)
        for b in evicted:
            self.pool.free(b)
        if len(evicted) != short:
            raise AssertionError(f"evicted {len(evicted)} of {short} blocks counted evictable")

    def _drop_refs(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.pool.decref(b) == 0:
                if self.cache.is_cached(b):
                    self.cache.mark_unreferenced(b)
                else:
                    self.pool.free(b)
                    self._freed.append(b)

    def _to_unknown(self, seq: KvSequence) -> None:
        check_transition(seq.state, S.UNKNOWN)
        safe = seq.committed_len // self.block_size
        tail = seq.blocks[safe:]
        self._drop_refs(seq.blocks[:safe])
        for b in tail:
            assert not self.cache.is_cached(b), f"block {b} written by a job but cached"
            if self.pool.decref(b) != 0:
                raise AssertionError(f"uncommitted block {b} shared")
        self.pool.quarantine(tail)
        seq.blocks = tail
        seq.state = S.UNKNOWN
        seq.pending_len = seq.next_len = None

    def _feed_cache(self, seq: KvSequence, tokens: Sequence[int]) -> None:
        if seq.key is None or seq.cache_stopped:
            return
        full = seq.committed_len // self.block_size
        if full <= seq.cache_blocks:
            return
        cache = self.cache
        if seq.cache_epoch == cache.epoch:  # our cached path is intact: add only the newly full blocks
            done = cache.extend(seq.key, seq.cache_tail, tokens, seq.blocks, seq.cache_blocks, full)
        else:  # nodes were dropped since (drop_key / clear): walk from the root
            done = cache.insert(seq.key, tokens[: full * self.block_size], seq.blocks[:full])
            seq.cache_epoch = cache.epoch
        if done < full:
            seq.cache_stopped = True
        if self.tier_sink is not None and done > seq.cache_blocks:
            self.tier_sink.append((seq, tokens, seq.cache_blocks, done, seq.blocks[seq.cache_blocks:done]))
        seq.cache_blocks = done
        seq.cache_tail = seq.blocks[done - 1] if done else None

    def _after(self, seq_id: int | None) -> None:
        if seq_id is not None:
            self._after_seq(self._seqs[seq_id])
        elif self.paranoid:
            self.check_invariants()

    def _after_seq(self, seq: KvSequence) -> None:
        """O(1) checks of the sequence just changed; the O(blocks) sweep only when paranoid."""
        assert seq.committed_len <= seq.reserved_len <= self.max_seq, seq
        if self.paranoid:
            self.check_invariants()

    # -- invariants ------------------------------------------------------------
    def check_invariants(self) -> None:
        """Each sequence's lengths (committed <= reserved <= max_seq), its job and its block table, every
        block's ref count, and block conservation; raises AssertionError naming the first violation."""

        def require(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(f"chip {self.chip}: {msg}")

        pool, cache, bs = self.pool, self.cache, self.block_size
        pool.check_invariants()
        cache.check_invariants()
        refs: Counter[int] = Counter()
        unknown_blocks: set[int] = set()
        for sid, seq in self._seqs.items():
            require(sid == seq.seq_id, f"seq {sid} filed under the wrong id")
            require(seq.state not in (S.FREE, S.RELEASING), f"seq {sid} stored in state {seq.state.name}")
            require(
                seq.cached_len <= seq.committed_len <= seq.reserved_len <= self.max_seq,
                f"seq {sid} lengths cached={seq.cached_len} committed={seq.committed_len} "
                f"reserved={seq.reserved_len} max={self.max_seq}",
            )
            require(seq.cached_len % bs == 0, f"seq {sid} cached_len not block aligned")
            require((seq.state is S.UPDATING) == (seq.pending_len is not None), f"seq {sid} pending_len vs state")
            if seq.next_len is not None:
                require(seq.state is S.UPDATING and seq.next_job is not None
                        and seq.pending_len < seq.next_len <= seq.reserved_len, f"seq {sid} queued step out of range")
            require(len(set(seq.blocks)) == len(seq.blocks), f"seq {sid} block table repeats a block")
            if seq.state is S.UPDATING:
                require(seq.pending_job is not None, f"seq {sid} updating without a job")
                require(seq.committed_len < seq.pending_len <= seq.reserved_len, f"seq {sid} pending_len out of range")
            if seq.state is S.UNKNOWN:
                unknown_blocks.update(seq.blocks)
                continue
            require(not self.faulted, f"seq {sid} {seq.state.name} on a faulted chip")
            require(len(seq.blocks) == self.blocks_needed(seq.reserved_len), f"seq {sid} table size")
            refs.update(seq.blocks)
        quarantined = pool.quarantined()
        require(unknown_blocks <= quarantined, "an UNKNOWN sequence's block left quarantine")
        free = evictable = referenced = 0
        for b in range(pool.num_blocks):
            rc = pool.refcount(b)
            require(rc == refs[b], f"block {b} ref count {rc} != {refs[b]} references")
            if pool.is_free(b):
                require(not cache.is_cached(b), f"free block {b} still cached")
                free += 1
            elif b in quarantined:
                require(not cache.is_cached(b), f"quarantined block {b} still cached")
            elif rc > 0:
                require(not cache.is_cached(b) or cache.is_referenced(b), f"block {b} referenced but cache says not")
                referenced += 1
            else:
                require(cache.is_cached(b) and not cache.is_referenced(b), f"block {b} leaked (held, 0 refs, not cached)")
                evictable += 1
        require(evictable == cache.evictable(), "evictable count drifted")
        require(
            free + len(quarantined) + evictable + referenced == pool.num_blocks,
            "block conservation: free + quarantined + evictable + referenced != num_blocks",
        )

    def queued_steps(self) -> int:
        """Lanes with a second job queued behind their running one (`queue_next_step`): the queued steps in flight.

        O(sequences): for stats snapshots. A sequence made UNKNOWN keeps its job ids for late failures, so
        only UPDATING ones count.
        """
        return sum(1 for seq in self._seqs.values() if seq.next_job is not None and seq.state is S.UPDATING)

    def stats(self) -> dict:
        by_state = Counter(seq.state.value for seq in self._seqs.values())
        # Conservation (checked by check_invariants): held blocks are either referenced or evictable-cached.
        referenced = (
            self.pool.num_blocks - self.pool.num_free() - self.pool.num_quarantined() - self.cache.evictable()
        )
        return {
            "chip": self.chip,
            "faulted": self.faulted,
            "sequences": {s.value: by_state.get(s.value, 0) for s in S if s not in (S.FREE, S.RELEASING)},
            "blocks": {
                "total": self.pool.num_blocks,
                "free": self.pool.num_free(),
                "used": referenced,
                "cached": len(self.cache),
                "evictable": self.cache.evictable(),
                "quarantined": self.pool.num_quarantined(),
            },
            "prefix": {
                "hits": self.cache.hits,
                "misses": self.cache.misses,
                "hit_tokens": self.cache.hit_tokens,
                "evictions": self.cache.evictions,
            },
            "grow_refusals": self.preempt_refusals,
            "released_in_flight": self.released_in_flight,
        }
