"""Prefill/decode hand-off between boards, sans I/O: the descriptor and the exporter's table of held KV.

A prefill board runs a prompt and samples the first token; a decode board
continues the stream. What passes between them is a `HandoffDescriptor`: who
holds the prompt's KV (board, hand-off id), which blocks, in which layout, and
the first token. The exporting board holds those blocks in a `HandoffTable`
until the decode board has taken them (claim, then release) or the hand-off
deadline passes, whichever is first; so an abort anywhere (client cancel, a
board killed, a failed transfer) frees the exporter's KV within the deadline.

Moving the bytes (the backend's export/import of a list of blocks: the
KV_EXPORT/KV_IMPORT jobs of docs/architecture.md, "KV tiers below the chips")
is not here: `KvHandoffSource`/`KvHandoffSink` are the narrow interface a
board plugs its capability into. A descriptor with no blocks, a sink that
cannot import (layout mismatch, checksum, timeout) or a claim that fails
all mean one thing: the decode board recomputes the prompt. Never wrong
output, never a lost request.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

BOARD_ROLES = ("mixed", "prefill", "decode")
DEFAULT_DEADLINE_S = 10.0  # how long an exporter holds a hand-off's KV for its decode board


@dataclass(frozen=True)
class HandoffDescriptor:
    """What a decode board needs to take over a request: the wire's `handoff` object of a decode leg."""

    board: str  # the exporting board (its endpoint, or its board id)
    request: str  # the hand-off id on that board
    prompt_len: int = 0  # tokens whose KV the exporter holds (0: nothing exported; recompute)
    blocks: tuple[int, ...] = ()
    layout: Mapping[str, Any] | None = None  # model generation, KV dtype, block size, layers (the exporter's)
    first_token: int | None = None

    @property
    def exported(self) -> bool:
        """The exporter says it ran a prompt (whose full blocks it wrote to its tiers, by chain hash)."""
        return self.prompt_len > 0

    def to_wire(self) -> dict:
        out: dict[str, Any] = {"board": self.board, "request": self.request, "prompt_len": self.prompt_len,
                               "blocks": list(self.blocks)}
        if self.layout is not None:
            out["layout"] = dict(self.layout)
        if self.first_token is not None:
            out["first_token"] = self.first_token
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> "HandoffDescriptor":
        """From a `handoff` object the wire schema already checked."""
        return cls(board=str(obj["board"]), request=str(obj["request"]), prompt_len=int(obj.get("prompt_len", 0)),
                   blocks=tuple(int(b) for b in obj.get("blocks", ())), layout=obj.get("layout"),
                   first_token=obj.get("first_token"))


class ImportOutcome(enum.Enum):
    IMPORTED = "imported"  # the prompt's KV was found at the exporter and handed to this board's tiers to import
    RECOMPUTED = "recomputed"  # nothing to import, or the import failed: the prompt is computed here


class KvHandoffSource(Protocol):
    """The exporting side of a board's KV capability: hold and expose a request's blocks."""

    def export(self, blocks: Sequence[int]) -> Mapping[str, Any] | None:
        """Export `blocks` for a peer; returns the layout, or None when the backend cannot."""

    def free(self, blocks: Sequence[int]) -> None:
        """The hand-off is over: the blocks go back to the pool."""


class KvHandoffSink(Protocol):
    """The importing side: make a descriptor's blocks reachable by this board's KV tiers, or say it cannot."""

    def stage(self, desc: HandoffDescriptor, tokens: Sequence[int], salt: str) -> int:
        """Blocks of `tokens` (the prompt, under tenant `salt`) now importable here; 0 means recompute.

        Staging is not the import: the scheduler promotes staged blocks at admission, and a record that
        turns out missing, torn or of another layout is refused there and recomputed."""


class HeldState(enum.Enum):
    HELD = "held"  # exported, waiting for its decode board
    CLAIMED = "claimed"  # a decode board is reading it
    RELEASED = "released"  # taken (or given up): freed
    EXPIRED = "expired"  # the deadline passed first: freed


_LEGAL = {HeldState.HELD: {HeldState.CLAIMED, HeldState.RELEASED, HeldState.EXPIRED},
          HeldState.CLAIMED: {HeldState.RELEASED, HeldState.EXPIRED},
          HeldState.RELEASED: set(), HeldState.EXPIRED: set()}


class HandoffError(Exception):
    """An illegal hand-off transition (a bug in the caller, never a peer's doing)."""


@dataclass
class Held:
    hid: str
    blocks: tuple  # block ids, or chain hashes (a disk tier's blocks are named by them)
    deadline: float
    state: HeldState = HeldState.HELD

    def to(self, state: HeldState) -> None:
        if state not in _LEGAL[self.state]:
            raise HandoffError(f"hand-off {self.hid}: {self.state.value} -> {state.value}")
        self.state = state


@dataclass
class HandoffTable:
    """The exporter's hand-offs. Every transition takes `now`; the blocks of an ended one are returned once.

    A claim keeps the deadline: a decode board that stalls mid-transfer loses
    the KV at the same time as one that never came, and falls back to
    recompute (its transfer fails the checksum or the length, never silently).
    """

    deadline_s: float = DEFAULT_DEADLINE_S
    _held: dict[str, Held] = field(default_factory=dict)
    _timers: list[tuple[float, str]] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=lambda: {k: 0 for k in (
        "held", "claimed", "released", "expired", "refused")})

    def hold(self, hid: str, blocks: Sequence, now: float, deadline_s: float | None = None) -> Held:
        if hid in self._held:
            raise HandoffError(f"hand-off {hid} is already held")
        h = Held(hid, tuple(blocks), now + (self.deadline_s if deadline_s is None else deadline_s))
        self._held[hid] = h
        heapq.heappush(self._timers, (h.deadline, hid))
        self.counters["held"] += 1
        return h

    def claim(self, hid: str, now: float) -> Held | None:
        """A decode board asks for `hid`; None when unknown, past its deadline or already claimed (recompute)."""
        h = self._held.get(hid)
        if h is None or h.state is not HeldState.HELD or now >= h.deadline:
            self.counters["refused"] += 1
            return None
        h.to(HeldState.CLAIMED)
        self.counters["claimed"] += 1
        return h

    def release(self, hid: str) -> tuple:
        """Taken, failed or aborted: the blocks to free (empty when it had already ended)."""
        h = self._held.pop(hid, None)
        if h is None:
            return ()
        h.to(HeldState.RELEASED)
        self.counters["released"] += 1
        return h.blocks

    def expire(self, now: float) -> list[tuple[str, tuple]]:
        """Hand-offs whose deadline passed: (id, blocks to free) each, once."""
        out = []
        while self._timers and self._timers[0][0] <= now:
            _, hid = heapq.heappop(self._timers)
            h = self._held.get(hid)
            if h is None or h.deadline > now:
                continue
            del self._held[hid]
            h.to(HeldState.EXPIRED)
            self.counters["expired"] += 1
            out.append((hid, h.blocks))
        return out

    def next_deadline(self) -> float | None:
        while self._timers and self._timers[0][1] not in self._held:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    def held(self) -> list[Held]:
        return list(self._held.values())

    def held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._held.values())

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, hid: str) -> bool:
        return hid in self._held


def take_over(desc: HandoffDescriptor | None, sink: KvHandoffSink | None, tokens: Sequence[int] = (),
              salt: str = "") -> tuple[ImportOutcome, int]:
    """The decode board's one decision: stage the import when there is something to import and a sink
    that can; (outcome, blocks staged)."""
    if desc is None or not desc.exported or sink is None:
        return ImportOutcome.RECOMPUTED, 0
    try:
        n = int(sink.stage(desc, tokens, salt))
    except Exception:  # a sink's failure of any kind is a recompute, never a lost request
        n = 0
    return (ImportOutcome.IMPORTED, n) if n > 0 else (ImportOutcome.RECOMPUTED, 0)
