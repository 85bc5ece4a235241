"""KV transfer between boards, sans I/O: the decode board pulls a hand-off's block records in chunks.

The prefill board serves what its `HandoffTable` holds on a transfer endpoint
(`board.handoff_endpoint`); a decode board that has the descriptor pulls:

    decode                              prefill
    claim {tid, hid, credit: W, sums}  ->                 the hold is claimed (refused: recompute)
                                  <-    meta {tid, blocks: n}
                                  <-    chunk {tid, seq, crc | crc32c, sizes} + payload   (one per credit)
    credit {tid, n}               ->                      the receiver grants more as it consumes
    release {tid, hid, ok}        ->                      the prefill board frees the hold now

Credit-based flow control (the ZeroMQ Guide's "credit-based flow control"):
the sender sends a chunk only against a credit, so a slow decode board is
never flooded and the prefill board never queues more than W chunks.
Each chunk carries a checksum of its payload: CRC-32C (`crc32c`) when the
claim lists "crc32c" in `sums` (hardware speed), else zlib's CRC-32 (`crc`),
which is what a receiver that sends no `sums` gets and what a sender that
ignores them sends, so either side may be older. Each record in it carries its own
layout tag, chain hash and CRC (ipc/kv_slots.py), which the shell checks
through `verify`. Any failure (refusal, checksum, order, a peer silent for
`timeout_s`) ends the pull FAILED and sends a release: the decode board then
recomputes the prompt. Never wrong output, never a lost request.

Times are passed in (`now`): the state machines never read a clock.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ipc.kv_checksum import crc32c

SUMS = ("crc32c",)  # chunk checksums a receiver accepts besides CRC-32 (`crc`), fastest first
DEFAULT_CREDIT = 4  # chunks in flight per transfer
DEFAULT_CHUNK_BLOCKS = 16  # records per chunk
DEFAULT_TIMEOUT_S = 2.0  # a transfer silent this long has failed (the receiver recomputes)
EXPORT_GRACE_S = 0.5  # how long the sender waits for a held block whose export job is still in flight


class PullState(enum.Enum):
    CLAIMING = "claiming"  # claim sent, no meta yet
    RECEIVING = "receiving"
    DONE = "done"  # every block received and checked
    FAILED = "failed"  # recompute


@dataclass
class Pull:
    """The receiving side of one transfer. `outbox` holds the messages (header, payload) to send."""

    tid: str
    hid: str
    want: int  # blocks the receiver can use (its own chain hashes of the prompt)
    now: float
    credit: int = DEFAULT_CREDIT
    timeout_s: float = DEFAULT_TIMEOUT_S
    verify: Callable[[int, bytes], None] | None = None  # (block index, record) -> raises when refused
    state: PullState = PullState.CLAIMING
    total: int = 0
    records: list[bytes] = field(default_factory=list)
    failure: str = ""
    outbox: list[tuple[dict, bytes | None]] = field(default_factory=list)
    _seq: int = 0
    _granted: int = 0  # credits outstanding at the sender
    _last: float = 0.0

    def __post_init__(self) -> None:
        self._last = self.now
        self._granted = self.credit
        self.outbox.append(({"t": "claim", "tid": self.tid, "hid": self.hid, "credit": self.credit,
                             "want": self.want, "sums": list(SUMS)}, None))

    @property
    def finished(self) -> bool:
        return self.state in (PullState.DONE, PullState.FAILED)

    def on_message(self, hdr: dict, payload: bytes | None, now: float) -> None:
        if self.finished:
            return
        self._last = now
        t = hdr.get("t")
        if t == "meta" and self.state is PullState.CLAIMING:
            self.total = max(0, min(int(hdr.get("blocks", 0)), self.want))
            self.state = PullState.RECEIVING
            if self.total == 0:
                self._fail("empty")
            return
        if t == "refused":
            self._fail(f"refused: {hdr.get('reason', '?')}")
            return
        if t == "chunk" and self.state is PullState.RECEIVING:
            self._chunk(hdr, payload or b"")
            return
        self._fail(f"unexpected {t!r} in {self.state.value}")

    def _chunk(self, hdr: dict, payload: bytes) -> None:
        if hdr.get("seq") != self._seq:
            return self._fail("order")
        if "crc32c" in hdr:
            if crc32c(payload) != hdr["crc32c"]:
                return self._fail("checksum")
        elif zlib.crc32(payload) != hdr.get("crc"):
            return self._fail("checksum")
        sizes = hdr.get("sizes") or []
        if sum(sizes) != len(payload) or not sizes:
            return self._fail("length")
        off = 0
        for n in sizes:
            rec = payload[off:off + n]
            off += n
            if len(self.records) >= self.total:
                return self._fail("length")
            if self.verify is not None:
                try:
                    self.verify(len(self.records), rec)
                except Exception as e:  # a record of another layout or prefix, torn: recompute
                    return self._fail(f"record: {e}")
            self.records.append(rec)
        self._seq += 1
        self._granted -= 1
        if len(self.records) >= self.total:
            self.state = PullState.DONE
            self.outbox.append(({"t": "release", "tid": self.tid, "hid": self.hid, "ok": True}, None))
            return
        if self._granted <= self.credit // 2:  # top the window up in batches, not one message per chunk
            more = self.credit - self._granted
            self._granted += more
            self.outbox.append(({"t": "credit", "tid": self.tid, "n": more}, None))

    def tick(self, now: float) -> None:
        if not self.finished and now - self._last >= self.timeout_s:
            self._fail("timeout")

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.finished:
            self._fail(reason)

    def deadline(self) -> float | None:
        return None if self.finished else self._last + self.timeout_s

    def _fail(self, why: str) -> None:
        self.state, self.failure = PullState.FAILED, why
        self.records = []
        self.outbox.append(({"t": "release", "tid": self.tid, "hid": self.hid, "ok": False}, None))


class ServeState(enum.Enum):
    WAITING = "waiting"  # a held block's export is still in flight
    SENDING = "sending"
    ENDED = "ended"


@dataclass
class Serve:
    """The sending side of one transfer: `chains` (the hold's, in prompt order) against the receiver's credit.

    `available(chain)` says True (ready to read), False (export still in flight) or None (not here);
    `read(chain)` returns the record's bytes or None (gone since)."""

    tid: str
    hid: str
    chains: Sequence[bytes]
    now: float
    credit: int = 0
    chunk_blocks: int = DEFAULT_CHUNK_BLOCKS
    timeout_s: float = DEFAULT_TIMEOUT_S
    grace_s: float = EXPORT_GRACE_S
    sums: Sequence[str] = ()  # the receiver's claim's `sums`: the chunk checksums it accepts besides CRC-32
    state: ServeState = ServeState.WAITING
    total: int = 0
    sent: int = 0
    outbox: list[tuple[dict, bytes | None]] = field(default_factory=list)
    _seq: int = 0
    _t0: float = 0.0
    _last: float = 0.0

    def __post_init__(self) -> None:
        self._t0 = self._last = self.now

    def on_message(self, hdr: dict, now: float) -> None:
        self._last = now
        if hdr.get("t") == "credit":
            self.credit += max(0, int(hdr.get("n", 0)))
        elif hdr.get("t") == "release":
            self.state = ServeState.ENDED

    def pump(self, now: float, available: Callable[[bytes], bool | None],
             read: Callable[[bytes], bytes | None]) -> None:
        """Send what the credit allows (the meta first, once the held blocks are exported or the grace is over)."""
        if self.state is ServeState.ENDED:
            return
        if now - self._last >= self.timeout_s:  # the receiver is gone: it recomputes; the hold's deadline frees it
            self.state = ServeState.ENDED
            return
        if self.state is ServeState.WAITING:
            n = 0
            for c in self.chains:
                a = available(c)
                if a is True:
                    n += 1
                    continue
                if a is False and now - self._t0 < self.grace_s:
                    return  # wait for the export job (pump again next turn)
                break
            self.total, self.state = n, ServeState.SENDING
            self.outbox.append(({"t": "meta", "tid": self.tid, "blocks": n}, None))
            if n == 0:
                self.state = ServeState.ENDED
                return
        while self.credit > 0 and self.sent < self.total:
            recs = []
            for c in self.chains[self.sent:min(self.total, self.sent + self.chunk_blocks)]:
                r = read(c)
                if r is None:
                    break
                recs.append(r)
            if not recs:  # evicted since the meta: the receiver recomputes
                self.outbox.append(({"t": "refused", "tid": self.tid, "reason": "evicted"}, None))
                self.state = ServeState.ENDED
                return
            payload = b"".join(recs)
            hdr = {"t": "chunk", "tid": self.tid, "seq": self._seq, "sizes": [len(r) for r in recs]}
            if "crc32c" in self.sums:
                hdr["crc32c"] = crc32c(payload)
            else:
                hdr["crc"] = zlib.crc32(payload)
            self.outbox.append((hdr, payload))
            self._seq += 1
            self.sent += len(recs)
            self.credit -= 1
            if self.sent < self.total and len(recs) < self.chunk_blocks:  # a block went missing mid-way
                self.outbox.append(({"t": "refused", "tid": self.tid, "reason": "evicted"}, None))
                self.state = ServeState.ENDED
                return

    @property
    def waiting(self) -> bool:
        return self.state is ServeState.WAITING

    def expired(self, now: float) -> bool:
        return self.state is ServeState.ENDED or now - self._last >= self.timeout_s
