"""A prefill board keeps each hand-off's prompt blocks for its decode board until `board.handoff_deadline_s`.

The blocks are the disk tier's block files of the prompt (named by chain hash; write-through puts them
there). Held, they are pinned in the tier index as readers, so the tier's LRU cannot evict one before
the decode board has read it (and so are their host slots, which a decode board on this host reads
straight from shared memory, shm.py); at the deadline they are unpinned (and evictable again). An entry still
being exported is pinned at the next supervision turn (`Generation.supervise`, every
`recovery.supervise_interval_ms`), so the deadline holds to within one such turn. The disk-tier
hand-off has no claim from the decode board (it reads the files itself), so such a hold lasts its deadline;
a pull over the transfer endpoint (transfer.py) claims the hold and releases it as soon as it ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.handoff import HandoffTable
from engine.core.kv.chain_hash import chain_of
from engine.core.kv.tier_index import EntryState, TierEntry


class HandoffHold:
    def __init__(self, deadline_s: float) -> None:
        self.table = HandoffTable(deadline_s)
        self._pins: dict[str, list[TierEntry]] = {}
        self._todo: dict[str, list[bytes]] = {}  # chains not pinned yet (their export is still in flight)
        self._host_pins: dict[str, list[TierEntry]] = {}  # the same blocks' host slots, when there

    def hold(self, shell, hid: str, tokens: Sequence[int], salt: str, now: float) -> int:
        """Hold the prompt's full blocks (not the one of its last token: a decode board computes that)."""
        tiers = shell.tiers
        if tiers.disk is None:
            return 0
        bs = tiers.block_size
        chains = chain_of(tiers.root(salt), tokens[:((len(tokens) - 1) // bs) * bs], bs)
        if not chains:
            return 0
        self.table.hold(hid, chains, now)
        self._pins[hid], self._todo[hid] = [], list(chains)
        self.tick(shell, now)
        return len(chains)

    def tick(self, shell, now: float) -> int:
        """Pin what has been exported since; unpin what is past its deadline. Returns hand-offs expired."""
        disk, host = shell.tiers.disk, shell.tiers.host
        for hid, todo in self._todo.items():
            while todo:
                e = disk.entry(todo[0])
                if e is None or e.state is not EntryState.READY:
                    break
                self._pins[hid] += disk.pin([todo[0]])
                h = host.entry(todo[0]) if host is not None else None
                if h is not None and h.state is EntryState.READY:  # its host slot, read by a decode board on
                    self._host_pins.setdefault(hid, []).extend(host.pin([todo[0]]))  # this host (shm.py)
                todo.pop(0)
        expired = self.table.expire(now)
        for hid, _ in expired:
            disk.unpin(self._pins.pop(hid, []))
            if host is not None:
                host.unpin(self._host_pins.pop(hid, []))
            self._todo.pop(hid, None)
        return len(expired)

    def claim(self, hid: str, now: float):
        """A decode board's claim (engine/daemon/handoff/transfer.py): the Held, or None (unknown, expired, taken)."""
        return self.table.claim(hid, now)

    def release(self, shell, hid: str) -> bool:
        """The decode board has the blocks, or gave up: unpin them now, not at the deadline."""
        ended = bool(self.table.release(hid))
        self._todo.pop(hid, None)
        pins = self._pins.pop(hid, [])
        if pins:
            shell.tiers.disk.unpin(pins)
        host_pins = self._host_pins.pop(hid, [])
        if host_pins:
            shell.tiers.host.unpin(host_pins)
        return ended

    def pinned_blocks(self) -> int:
        return sum(len(p) for p in self._pins.values())
