"""An all-reduce (sum) over POSIX shared memory, for the workers of one tensor-parallel replica.

Why here: the chips of a replica are worker processes and their interconnect
is shared memory, so the collective a vendor runtime (NCCL, HCCL) would
provide is built from a segment and counters, like the rings.

Layout of the segment (made by the replica's owner, the daemon; workers
attach by name): a header with one 64-byte line per rank (arrive counter,
gather counter, pid) plus a global abort word, then two parities x `world`
input slots of `slot_bytes` each, then two parities of one output slot.

Two algorithms, chosen by `mode`:

* `shared` (default, measured faster for the sizes a decode step moves): every
  rank writes its partial into its slot, publishes its arrive counter, waits
  for every peer's, then sums all slots itself in rank order.
* `rsag` (reduce-scatter + all-gather): each rank sums only its 1/world chunk
  of all slots into the output slot, publishes a gather counter, waits for
  every peer's, then copies the whole output. Less arithmetic per rank, one
  more barrier.

Either way every rank gets bitwise the same sum (same operands, same order),
which keeps the replicated residual stream identical on every rank.

The `shared` step runs in C when the transport's C library is available
(`ipc.native_lib`: slot write, counter store, a short spin for the peers and
the sum in one call, the same summation order as NumPy's, so the same bits);
a peer late past the spin budget, the deadlines, liveness checks and the
abort stay here in Python. Without the library the step runs in NumPy.

Two parities make one barrier per call enough: a rank can be at most one call
ahead of the slowest (it waits for everyone's arrive counter of its call), so
it never writes the slot a slower rank is still reading.

A barrier never deadlocks: every wait has a deadline (`timeout_s`), checks the
abort word and, every few milliseconds, whether the peers it waits for are
still alive. A rank that gives up sets the abort word, so the others give up
at once instead of at their own deadlines; an aborted group stays aborted (the
replica's workers are restarted together, with a fresh segment). Payloads
larger than a slot are reduced slot by slot.
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np

from ipc import native_lib
from ipc.fence import fence
from ipc.shm import SHM_PREFIX, Segment

_LINE = 64  # bytes per header line (one cache line: no false sharing of counters)
_WORDS = _LINE // 8
_MAGIC = 0x4E50_5441_4C52  # "NPTALR"
_ARRIVE, _GATHER, _PID = 0, 1, 2  # words of a rank's header line
_G_MAGIC, _G_WORLD, _G_SLOT, _G_ABORT = 0, 1, 2, 3  # words of the global line (line 0)
MODES = ("shared", "rsag")
_LIVENESS_EVERY_S = 0.002
_SPIN_S = 0.0002
_SPIN_NS = int(_SPIN_S * 1e9)


def _address(a: np.ndarray) -> int:
    """The address of a C-contiguous array's data (c_char.from_buffer: a third of `a.ctypes.data`'s cost)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):  # read-only or empty
        return a.ctypes.data


class CollectiveError(RuntimeError):
    """The collective cannot complete: a peer died, hung past the deadline, or the group was aborted."""


def segment_size(world: int, slot_bytes: int) -> int:
    header = _LINE * (1 + world)
    return header + 2 * world * slot_bytes + 2 * slot_bytes


def _pid_state(pid: int) -> str:
    """'' when the process runs (or sleeps), 'dead' when gone or a zombie, 'stopped' when SIGSTOPped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "dead"
    except PermissionError:
        return ""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    if state in (b"Z", b"X"):
        return "dead"
    if state in (b"T", b"t"):
        return "stopped"
    return ""


def create_group(board: str | int, world: int, slot_bytes: int, prefix: str = SHM_PREFIX) -> Segment:
    """Make the group's segment (the caller owns it: close and unlink it when the replica stops)."""
    if world < 1:
        raise ValueError("world must be >= 1")
    if slot_bytes <= 0 or slot_bytes % _LINE:
        raise ValueError(f"slot_bytes must be a positive multiple of {_LINE}")
    seg = Segment.create(prefix, board, segment_size(world, slot_bytes), tag="ar")
    hdr = np.frombuffer(seg.buf, dtype=np.int64, count=_WORDS * (1 + world))
    hdr[:] = 0
    hdr[_G_WORLD], hdr[_G_SLOT] = world, slot_bytes
    fence()
    hdr[_G_MAGIC] = _MAGIC
    return seg


def aborted_by(seg: Segment) -> int | None:
    """The rank that aborted the group of segment `seg` (its owner's view), or None while it is whole."""
    word = int(np.frombuffer(seg.buf, dtype=np.int64, count=_WORDS)[_G_ABORT])
    return word - 1 if word else None


class AllReduce:
    """One rank's handle on a group: `allreduce(x)` returns the sum of every rank's `x`.

    Not thread-safe; one per worker process. Every rank must make the same
    sequence of calls with arrays of the same shape (the replica's workers run
    the same jobs in the same order).
    """

    def __init__(self, name: str, rank: int, *, timeout_s: float = 30.0, mode: str = "shared") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.segment = Segment.attach(name)
        head = np.frombuffer(self.segment.buf, dtype=np.int64, count=_WORDS)
        if int(head[_G_MAGIC]) != _MAGIC:
            self.segment.close()
            raise ValueError(f"{name} is not an all-reduce segment")
        self.world = int(head[_G_WORLD])
        self.slot_bytes = int(head[_G_SLOT])
        if not 0 <= rank < self.world:
            self.segment.close()
            raise ValueError(f"rank {rank} outside 0..{self.world - 1}")
        self.rank = rank
        self.mode = mode
        self.timeout_s = float(timeout_s)
        buf = self.segment.buf
        self._glob = np.frombuffer(buf, dtype=np.int64, count=_WORDS)
        self._hdr = np.frombuffer(buf, dtype=np.int64, count=_WORDS * self.world, offset=_LINE).reshape(self.world, _WORDS)
        n_slot = self.slot_bytes // 4
        off = _LINE * (1 + self.world)
        self._inputs = np.frombuffer(buf, dtype=np.float32, count=2 * self.world * n_slot, offset=off
                                     ).reshape(2, self.world, n_slot)
        off += 2 * self.world * self.slot_bytes
        self._outputs = np.frombuffer(buf, dtype=np.float32, count=2 * n_slot, offset=off).reshape(2, n_slot)
        self._peers = tuple(r for r in range(self.world) if r != rank)
        self._calls = int(self._hdr[rank, _ARRIVE])  # rejoining the same group is not supported; start at its count
        self._hdr[rank, _PID] = os.getpid()
        self.wait_s = 0.0  # time spent waiting for peers (the barrier's share of the collective)
        self._lib = native_lib.library() if mode == "shared" else None
        self._waited = np.zeros(1, np.int64)  # the C step's spin time, ns
        inputs = self._inputs.ctypes.data
        self._ctx = np.array([inputs, inputs + self.world * self.slot_bytes, self.slot_bytes // 4, self.world, rank,
                              self._hdr.ctypes.data, _WORDS, _ARRIVE, self._glob.ctypes.data + 8 * _G_ABORT, _SPIN_NS,
                              self._waited.ctypes.data], np.int64)  # npi_ar_step's fixed arguments
        self._ctx_ptr = self._ctx.ctypes.data

    # ---- the collective ------------------------------------------------------------

    def allreduce(self, x: np.ndarray) -> np.ndarray:
        """Sum of `x` over all ranks (a new float32 array of x's shape); CollectiveError on any failure."""
        a = np.ascontiguousarray(x, dtype=np.float32)
        if self.world == 1:
            return a.copy()
        out = np.empty(a.shape, np.float32)
        if self._lib is not None and a.size <= self.slot_bytes // 4:  # one slot: straight to C
            self._calls += 1
            self._one_c(a, out, self._calls)
            return out
        flat, res = a.reshape(-1), out.reshape(-1)
        n_slot = self.slot_bytes // 4
        for lo in range(0, max(flat.size, 1), n_slot):
            hi = min(flat.size, lo + n_slot)
            self._one(flat[lo:hi], res[lo:hi])
        return out

    def _one(self, part: np.ndarray, res: np.ndarray) -> None:
        self._calls += 1
        n, size, par = self._calls, part.size, self._calls & 1
        if self._lib is not None:
            self._one_c(part, res, n)
            return
        slots = self._inputs[par]
        slots[self.rank, :size] = part
        fence()
        self._hdr[self.rank, _ARRIVE] = n
        self._wait(_ARRIVE, n)
        fence()
        if self.mode == "shared":
            np.add(slots[0, :size], slots[1, :size], out=res)
            for r in range(2, self.world):
                res += slots[r, :size]
            return
        chunk = -(-size // self.world)
        lo, hi = min(size, self.rank * chunk), min(size, (self.rank + 1) * chunk)
        outp = self._outputs[par]
        if hi > lo:
            np.add(slots[0, lo:hi], slots[1, lo:hi], out=outp[lo:hi])
            for r in range(2, self.world):
                outp[lo:hi] += slots[r, lo:hi]
        fence()
        self._hdr[self.rank, _GATHER] = n
        self._wait(_GATHER, n)
        fence()
        res[:] = outp[:size]

    def _one_c(self, part: np.ndarray, res: np.ndarray, n: int) -> None:
        """The `shared` step of call n in C; when the peers are late, the Python barrier, then the C sum."""
        lib = self._lib
        res_ptr = _address(res)
        late = lib.npi_ar_step(self._ctx_ptr, _address(part), res_ptr, part.size, n)
        spun = int(self._waited[0]) * 1e-9
        if not late:
            self.wait_s += spun
            return
        self._wait(_ARRIVE, n, spun)
        fence()
        lib.npi_ar_sum(int(self._ctx[n & 1]), self.slot_bytes // 4, self.world, part.size, res_ptr)

    def _wait(self, word: int, n: int, spun_s: float = 0.0) -> None:
        """Until every rank's `word` reaches n; CollectiveError (and abort) at the deadline or a dead peer.
        `spun_s`: how long the caller already spun for it (counted in the spin budget and the deadline)."""
        col = self._hdr[:, word]
        item, peers = self._hdr.item, self._peers
        if all(item(r, word) >= n for r in peers):  # .item() per peer: a third of col.min()'s cost
            self.wait_s += spun_s
            return
        t0 = time.monotonic() - spun_s
        deadline = t0 + self.timeout_s
        next_check = t0 + _LIVENESS_EVERY_S
        spin_until = t0 + _SPIN_S
        while True:
            if all(item(r, word) >= n for r in peers):
                self.wait_s += time.monotonic() - t0
                return
            now = time.monotonic()
            if self._glob[_G_ABORT]:
                raise CollectiveError(f"rank {self.rank}: the group was aborted by rank {int(self._glob[_G_ABORT]) - 1}")
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                for r in np.flatnonzero(col < n):
                    pid = int(self._hdr[r, _PID])
                    if pid and _pid_state(pid) == "dead":
                        self.abort()
                        raise CollectiveError(f"rank {self.rank}: peer rank {r} (pid {pid}) died")
                if now >= deadline:
                    lagging = [int(r) for r in np.flatnonzero(col < n)]
                    self.abort()
                    raise CollectiveError(f"rank {self.rank}: peer rank(s) {lagging} did not arrive within "
                                          f"{self.timeout_s:g} s")
            if now >= spin_until:  # a peer that is behind may be waiting for this core: give it up
                if now - t0 < 0.002:
                    os.sched_yield()
                else:
                    time.sleep(5e-5)

    # ---- failure and teardown ---------------------------------------------------------

    def abort(self) -> None:
        """Poison the group: every rank waiting, or calling later, gets CollectiveError at once."""
        if not self._glob[_G_ABORT]:
            self._glob[_G_ABORT] = self.rank + 1

    @property
    def calls(self) -> int:
        """Slot-sized collectives this group has run (a payload larger than a slot counts once per slot)."""
        return self._calls

    @property
    def aborted(self) -> bool:
        return bool(self._glob[_G_ABORT])

    def close(self) -> None:
        self._glob = self._hdr = self._inputs = self._outputs = None  # type: ignore[assignment]
        self.segment.close()
