"""`npuserve serve --trace FILE`: the loop's story as Chrome/Perfetto trace JSON.

Open the file in https://ui.perfetto.dev (or chrome://tracing). One process per
board, with:

* a "scheduler loop" thread: one slice per loop turn (what woke it, how many
  actions it produced) and instants for requests refused at submit;
* one thread per chip job slot ("chip 0 slot 0", ...; a chip with
  executor.max_inflight = 2 has two, so ping/pong overlap is visible): one slice
  per job, named prefill or decode, with its batch, active lanes, request ids,
  device and worker time, from the loop handing it over to the loop seeing its
  result ("lost" when the chip went down first);
* one "chip N device" thread per chip: the backend calls themselves, on the
  worker's clock (CLOCK_MONOTONIC, as the loop's), with an "idle" slice for
  each gap between one call's end and the next one's start: the overlap of
  host and device work is read off this track, not assumed;
* one async track per request: a "request" slice with nested "queued",
  "prefill" and "decode" phases, so a request that waited shows which queue it
  waited in while the chip slots show what ran instead.

Cost: nothing is recorded when the flag is absent (the loop holds None). When
on, each event is one orjson dump into a buffered file, and the file is bounded
by `max_events`; past it one "trace truncated" instant is written and
recording stops. The array format is used: the closing bracket is written on
shutdown, and a trace cut short by a crash still opens (the format allows a
missing `]`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, BinaryIO

import orjson

from engine.core.actions import FailRequest, FinishRequest, SubmitJob

if TYPE_CHECKING:
    from ipc.records import JobResult

DEFAULT_MAX_EVENTS = 500_000  # about 80 MB of JSON
LOOP_TID = 1
_SLOT_TIDS = 16  # tid of (chip, slot) = 100 + chip * 16 + slot
_DEVICE_TID = 5000  # tid of chip N's device track = 5000 + N


class TraceWriter:
    """Writes trace events as the loop produces them. Loop thread only."""

    def __init__(self, path: str, *, board: str, pid: int | None = None, t0: float = 0.0,
                 max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.path = path
        self.pid = os.getpid() if pid is None else pid
        self.t0 = t0
        self.max_events = max_events
        self.events = 0
        self.truncated = False
        self._fh: BinaryIO | None = open(path, "wb", buffering=1 << 20)
        self._fh.write(b"[\n")
        self._first = True
        self._jobs: dict[int, tuple[int, int, int, str, int, list[int]]] = {}  # job -> (start us, chip, slot, ..)
        self._busy_slots: dict[int, set[int]] = {}
        self._named_slots: set[int] = set()
        self._meta("process_name", 0, {"name": f"npuserve board {board}"})
        self._meta("thread_name", LOOP_TID, {"name": "scheduler loop"})
        self._meta("thread_sort_index", LOOP_TID, {"sort_index": 0})

    # -- low level ------------------------------------------------------------------------
    def us(self, t: float) -> int:
        return int(round((t - self.t0) * 1e6))

    def _write(self, ev: dict) -> None:
        fh = self._fh
        if fh is None or self.truncated:
            return
        if self.events >= self.max_events:
            self.truncated = True
            ev = {"name": "trace truncated", "ph": "i", "s": "g", "pid": self.pid, "tid": LOOP_TID,
                  "ts": ev.get("ts", 0), "args": {"max_events": self.max_events}}
        self.events += 1
        fh.write(orjson.dumps(ev) if self._first else b",\n" + orjson.dumps(ev))
        self._first = False

    def _meta(self, name: str, tid: int, args: dict) -> None:
        self._write({"name": name, "ph": "M", "pid": self.pid, "tid": tid, "args": args})

    # -- the loop's hooks -------------------------------------------------------------------
    def turn(self, start: float, end: float, n_events: int, n_actions: int, blocked: str | None = None) -> None:
        """One loop turn; `blocked`: why admission left requests waiting (Scheduler.admission_blocked)."""
        ts = self.us(start)
        args = {"events": n_events, "actions": n_actions}
        if blocked is not None:
            args["admission_blocked"] = blocked
        self._write({"name": "turn", "ph": "X", "pid": self.pid, "tid": LOOP_TID, "ts": ts,
                     "dur": max(0, self.us(end) - ts), "args": args})

    def on_actions(self, actions: list, now: float) -> None:
        for a in actions:
            t = type(a)
            if t is SubmitJob:
                self._job_started(a, now)
            elif t is FinishRequest:
                self._request(a.request_id, a.timing, now, {"finish_reason": a.finish_reason, **a.usage})
            elif t is FailRequest:
                args = {"code": a.code, "reason": a.reason}
                if a.timing is None:
                    self._write({"name": "rejected", "ph": "i", "s": "t", "pid": self.pid, "tid": LOOP_TID,
                                 "ts": self.us(now), "args": {"request": a.request_id, **args}})
                else:
                    self._request(a.request_id, a.timing, now, args)

    def _job_started(self, a: SubmitJob, now: float) -> None:
        busy = self._busy_slots.setdefault(a.chip, set())
        slot = 0
        while slot in busy:
            slot += 1
        busy.add(slot)
        tid = 100 + a.chip * _SLOT_TIDS + min(slot, _SLOT_TIDS - 1)
        if tid not in self._named_slots:
            self._named_slots.add(tid)
            self._meta("thread_name", tid, {"name": f"chip {a.chip} slot {slot}"})
            self._meta("thread_sort_index", tid, {"sort_index": tid})
        job = a.job
        self._jobs[job.job_id] = (self.us(now), a.chip, slot, job.kind.name.lower(), job.batch,
                                  list(a.request_ids))

    def _job_ended(self, job_id: int, now: float, args: dict) -> None:
        start, chip, slot, kind, batch, rids = self._jobs.pop(job_id)
        self._busy_slots[chip].discard(slot)
        self._write({"name": kind, "ph": "X", "pid": self.pid, "tid": 100 + chip * _SLOT_TIDS + min(slot, _SLOT_TIDS - 1),
                     "ts": start, "dur": max(0, self.us(now) - start),
                     "args": {"job": job_id, "chip": chip, "batch": batch, "lanes": len(rids), "requests": rids,
                              **args}})

    def on_result(self, chip: int, result: "JobResult", now: float) -> None:
        if result.job_id in self._jobs and self._jobs[result.job_id][1] == chip:
            if result.device_start_ns:
                self._device_call(chip, result)
            self._job_ended(result.job_id, now, {"status": result.status.name.lower(),
                                                 "device_ms": result.device_us / 1000.0,
                                                 "worker_ms": result.worker_us / 1000.0})

    def _device_call(self, chip: int, result: "JobResult") -> None:
        tid = _DEVICE_TID + chip
        if tid not in self._named_slots:
            self._named_slots.add(tid)
            self._meta("thread_name", tid, {"name": f"chip {chip} device"})
            self._meta("thread_sort_index", tid, {"sort_index": tid})
        ts = max(0, self.us(result.device_start_ns / 1e9))
        if result.idle_us >= 0:
            gap_ts = max(0, ts - result.idle_us)
            self._write({"name": "idle", "ph": "X", "pid": self.pid, "tid": tid, "ts": gap_ts,
                         "dur": ts - gap_ts, "args": {"chip": chip, "gap_us": result.idle_us}})
        self._write({"name": "device " + result.kind.name.lower(), "ph": "X", "pid": self.pid, "tid": tid, "ts": ts,
                     "dur": result.device_us, "args": {"job": result.job_id, "chip": chip}})

    def on_chip_down(self, chip: int, now: float) -> None:
        for job_id in [j for j, v in self._jobs.items() if v[1] == chip]:
            self._job_ended(job_id, now, {"status": "lost"})

    def _request(self, rid: int, timing: dict, now: float, args: dict) -> None:
        """The request's phases, reconstructed from its timing at its terminal event."""
        end = self.us(now)
        e2e = timing.get("e2e_ms")
        if e2e is None:
            return
        arrival = end - int(round(e2e * 1000))

        def at(ms: float | None) -> int | None:
            return None if ms is None else min(end, arrival + int(round(ms * 1000)))

        first_job = at(timing.get("queue_ms"))
        first_token = at(timing.get("ttft_ms"))
        phases = []
        if first_job is not None:
            phases.append(("queued", arrival, first_job))
            if first_job < end:
                phases.append(("prefill", first_job, first_token if first_token is not None else end))
        if first_token is not None and first_token < end:
            phases.append(("decode", first_token, end))
        ident = f"r{rid}"
        base = {"cat": "request", "id": ident, "pid": self.pid, "tid": LOOP_TID}
        # chronological, an end before a begin at the same instant: phases nest in the request, not in each other
        self._write({"name": "request", "ph": "b", "ts": arrival, "args": {"request": rid, **args}, **base})
        for name, b, e in phases:
            self._write({"name": name, "ph": "b", "ts": b, **base})
            self._write({"name": name, "ph": "e", "ts": e, **base})
        self._write({"name": "request", "ph": "e", "ts": end, **base})

    def close(self) -> None:
        fh = self._fh
        if fh is None:
            return
        self._fh = None
        fh.write(b"\n]\n")
        fh.close()
