"""The workers of one tensor-parallel replica, seen by the generation as one chip.

A replica spans `board.chips_per_replica` chips (docs/backends.md). The scheduler
treats it as it treats a chip: one KV manager, lanes, prefix cache and jobs in
flight. This link sends each job to every rank's worker at once (each has its
own rings, as a chip does), passes rank 0's result up and drops the others'.
It owns the replica's all-reduce segment (`ipc.allreduce`): made before the
workers start, unlinked when they stop, made afresh on every restart, so no
segment outlives the replica.

Failures are the replica's: a rank that dies, stops heartbeating or reports a
start-up failure fails the whole replica, and `restart()` restarts every rank
together (an all-reduce group cannot take back one rank). A collective that
gave up (a peer died or hung past `tp_timeout_s`) poisons the group; the link
notices the abort word after the failed results arrive and reports
`WorkerFailed`, so the generation restarts the replica even when every
process is still alive.

Same surface as `ChipLink` (start/stop/restart/kill/request_stop/is_alive,
submit/release_blocks/chaos/handle_events, info/pid/last_heartbeat), plus
`pollables()` (every rank's socket and result doorbell).
"""

from __future__ import annotations

from collections import deque

import zmq

from engine.daemon.chip_link import SHM_PREFIX, ChipLink, Heartbeat, LinkEvent, Ready, Result, WorkerFailed
from ipc.allreduce import aborted_by, create_group
from ipc.records import Job
from ipc.ring import RingFull
from ipc.shm import Segment
from workers.backends.base import BackendInfo

ALLREDUCE_SLOT_BYTES = 1 << 20  # larger payloads are reduced slot by slot


class ReplicaLink:
    """`world` ChipLinks of one replica. Single-threaded use only (the loop)."""

    def __init__(self, *, ctx: zmq.Context, board: str, replica: int, chips: list[int], backend: str,
                 backend_options: list[dict], tp_timeout_s: float, **link_kwargs) -> None:
        self.board = str(board)
        self.chip = int(replica)  # the scheduler's "chip" id: the replica's index
        self.chips = list(chips)
        self.world = len(chips)
        self.tp_timeout_s = float(tp_timeout_s)
        self.links = [ChipLink(ctx=ctx, board=board, chip=c, backend=backend,
                               backend_options=dict(opts, tp_rank=r, tp_world=self.world,
                                                    tp_timeout_s=self.tp_timeout_s),
                               **link_kwargs)
                      for r, (c, opts) in enumerate(zip(chips, backend_options))]
        self.segment: Segment | None = None
        self._ready: dict[int, Ready] = {}
        self._pending: list[deque[Job]] = [deque() for _ in chips]  # jobs a full ring of rank r > 0 still owes
        self._abort_reported = False

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        assert self.segment is None, "ReplicaLink.start() on a running replica"
        self.segment = create_group(self.board, self.world, ALLREDUCE_SLOT_BYTES, prefix=SHM_PREFIX)
        self._ready.clear()
        self._abort_reported = False
        for q in self._pending:
            q.clear()
        try:
            for lk in self.links:
                lk.backend_options["tp_group"] = self.segment.name
                lk.start()
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 2.0) -> None:
        for lk in self.links:
            lk.stop(timeout)
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def request_stop(self) -> None:
        for lk in self.links:
            lk.request_stop()

    def kill(self) -> None:
        for lk in self.links:
            lk.kill()

    def is_alive(self) -> bool:
        return all(lk.is_alive() for lk in self.links)

    def pollables(self) -> list:
        return [p for lk in self.links for p in lk.pollables()]

    # -- what the generation reads --------------------------------------------------
    @property
    def info(self) -> BackendInfo | None:
        return self.links[0].info if len(self._ready) == self.world else None

    @property
    def pid(self) -> int | None:
        return self.links[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [lk.pid for lk in self.links]

    def ring_layout_stats(self) -> dict | None:
        """Rank 0's ring ends (every rank's job record has the same shape)."""
        return self.links[0].ring_layout_stats()

    @property
    def last_heartbeat(self) -> float:
        return min(lk.last_heartbeat for lk in self.links)  # the stalest rank speaks for the replica

    # -- traffic --------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """To every rank. RingFull only when rank 0's ring is full (nothing sent); a full ring of another
        rank keeps the job here until it has room (its worker would block in the all-reduce meanwhile)."""
        self._flush()
        self.links[0].submit(job)
        for r in range(1, self.world):
            if self._pending[r]:
                self._pending[r].append(job)
                continue
            try:
                self.links[r].submit(job)
            except RingFull:
                self._pending[r].append(job)

    def _flush(self) -> None:
        for r, q in enumerate(self._pending):
            while q:
                try:
                    self.links[r].submit(q[0])
                except RingFull:
                    break
                q.popleft()

    def release_blocks(self, blocks: list[int]) -> None:
        self._flush()
        for r, lk in enumerate(self.links):
            if self._pending[r]:
                # A rank still owed jobs would apply the notice before them; the sharded backends keep their
                # KV in the blocks (the notice is advisory for them), so that rank goes without this one.
                continue
            lk.release_blocks(blocks)

    def chaos(self, action: str, seconds: float = 0.0, rank: int = 0) -> None:
        self.links[rank].chaos(action, seconds)

    def handle_events(self) -> list[LinkEvent]:
        out: list[LinkEvent] = []
        beat: Heartbeat | None = None
        for r, lk in enumerate(self.links):
            for ev in lk.handle_events():
                if isinstance(ev, Ready):
                    self._ready[r] = ev
                    if len(self._ready) == self.world:
                        out.append(self._ready[0])
                elif isinstance(ev, Result):
                    if r == 0:
                        out.append(ev)
                elif isinstance(ev, WorkerFailed):
                    out.append(WorkerFailed(f"rank {r} (chip {self.chips[r]}): {ev.message}"))
                elif isinstance(ev, Heartbeat) and r == 0:
                    beat = ev
        if beat is not None:
            out.append(beat)
        if self.segment is not None and not self._abort_reported:
            by = aborted_by(self.segment)
            if by is not None:
                self._abort_reported = True
                out.append(WorkerFailed(f"tensor-parallel all-reduce aborted by rank {by} "
                                        "(a peer died or hung): the replica restarts"))
        self._flush()
        return out

    def __enter__(self) -> "ReplicaLink":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
