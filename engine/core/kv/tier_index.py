"""The index of one KV tier below the device (host pool slots or disk block files), keyed by chain hash.

A tier entry is PENDING while a transfer job fills it (an export from a chip)
and READY once that job succeeded; only READY entries match, so a block
being demoted is never promoted before its bytes are there (the same block
demoted and promoted at once is simply a miss). An entry that transfers are
reading (`pin`) is never evicted or reused: eviction takes the least
recently used unpinned READY entry. A record the worker refused (corrupt,
truncated, missing) is `drop`ped: it stops matching at once, and its place
is reused once its last reader is done.

Plain data, no I/O: the slots and files themselves belong to the shell and
the workers. LRU order comes from insertion/touch order, never a clock.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class EntryState(enum.Enum):
    PENDING = "pending"
    READY = "ready"


@dataclass(eq=False)
class TierEntry:
    chain: bytes
    slot: int  # host slot index; -1 for a tier without slots (disk)
    state: EntryState
    readers: int = 0
    dropped: bool = False  # out of the index; its slot is freed when the last reader unpins


class TierIndex:
    def __init__(self, name: str, capacity: int, slotted: bool) -> None:
        if capacity <= 0:
            raise ValueError(f"{name} tier capacity must be positive")
        self.name = name
        self.capacity = capacity
        self.slotted = slotted
        self._free: list[int] = list(range(capacity - 1, -1, -1)) if slotted else []
        self._used = 0
        self._by_hash: dict[bytes, TierEntry] = {}
        self._lru: OrderedDict[bytes, TierEntry] = OrderedDict()  # READY entries, least recent first
        self.evicted: list[bytes] = []  # chains evicted since the shell last took them (disk: files to unlink)
        self.counters: Counter[str] = Counter()

    # -- queries ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, chain: bytes) -> bool:
        return chain in self._by_hash

    def entry(self, chain: bytes) -> TierEntry | None:
        return self._by_hash.get(chain)

    def ready_count(self) -> int:
        return len(self._lru)

    def pending_count(self) -> int:
        return sum(1 for e in self._by_hash.values() if e.state is EntryState.PENDING)

    def match(self, chains: Sequence[bytes]) -> int:
        """How many of `chains`, from the first, are READY here (no side effects)."""
        n = 0
        for h in chains:
            e = self._by_hash.get(h)
            if e is None or e.state is not EntryState.READY:
                break
            n += 1
        return n

    def chains(self) -> list[bytes]:
        """READY chains, least recently used first (what a persisted index lists)."""
        return list(self._lru)

    # -- transfers ---------------------------------------------------------------
    def pin(self, chains: Iterable[bytes]) -> list[TierEntry]:
        """Readers of READY entries (an import in flight); touches them as most recently used."""
        out = []
        for h in chains:
            e = self._by_hash[h]
            assert e.state is EntryState.READY, f"{self.name}: pin of a {e.state.value} entry"
            e.readers += 1
            self._lru.move_to_end(h)
            out.append(e)
        return out

    def unpin(self, entries: Iterable[TierEntry]) -> None:
        for e in entries:
            assert e.readers > 0, f"{self.name}: unpin below zero"
            e.readers -= 1
            if e.dropped and e.readers == 0:
                self._release(e)

    def claim(self, chain: bytes) -> TierEntry | None:
        """A new PENDING entry for `chain` (an export will fill it); None when present or no room."""
        if chain in self._by_hash:
            self.counters["duplicate"] += 1
            return None
        if self._used >= self.capacity and not self._evict_one():
            self.counters["full"] += 1
            return None
        slot = self._free.pop() if self.slotted else -1
        self._used += 1
        e = TierEntry(chain=chain, slot=slot, state=EntryState.PENDING)
        self._by_hash[chain] = e
        return e

    def adopt(self, chain: bytes) -> TierEntry | None:
        """A READY entry for a block already there (a persisted index read back at start)."""
        e = self.claim(chain)
        if e is not None:
            self.filled(e, True)
        return e

    def filled(self, e: TierEntry, ok: bool) -> None:
        """The transfer filling a PENDING entry ended: READY, or gone when it failed."""
        if e.dropped:
            return
        assert e.state is EntryState.PENDING
        if ok:
            e.state = EntryState.READY
            self._lru[e.chain] = e
            self.counters["stored"] += 1
        else:
            self.counters["store_failed"] += 1
            self.drop(e)

    def drop(self, e: TierEntry) -> None:
        """Stop indexing `e` (a refused record, a failed fill); its place is reused once unread."""
        if e.dropped:
            return
        e.dropped = True
        del self._by_hash[e.chain]
        self._lru.pop(e.chain, None)
        if e.readers == 0:
            self._release(e)

    # -- internals -------------------------------------------------------------------
    def _evict_one(self) -> bool:
        for h, e in self._lru.items():
            if e.readers == 0:
                self.counters["evicted"] += 1
                self.evicted.append(h)
                self.drop(e)
                return True
        return False

    def _release(self, e: TierEntry) -> None:
        self._used -= 1
        if self.slotted:
            self._free.append(e.slot)

    def take_evicted(self) -> list[bytes]:
        out, self.evicted = self.evicted, []
        return out

    def check_invariants(self) -> None:
        live = list(self._by_hash.values())
        assert all(not e.dropped for e in live)
        assert set(self._lru) == {e.chain for e in live if e.state is EntryState.READY}
        if self.slotted:
            slots = [e.slot for e in live]
            assert len(set(slots)) == len(slots), "two entries share a slot"
            assert not set(slots) & set(self._free), "a slot is both used and free"
        assert self._used <= self.capacity
