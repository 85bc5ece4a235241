"""How requests end: terminal states, expiry (deadlines, queue waits, hung jobs) and lanes lost with a job or chip.

A request whose terminal event has been emitted while one of its jobs is
still on the chip keeps its KV until that job drains (a job on the chip
cannot be recalled and writes the lane's blocks until it ends; its result for
the lane is dropped); `forget_if_done` drops the record once
nothing refers to it. A lane lost with a failed job or a dead chip is retried
while nothing reached the client, else failed (retryable elsewhere).
"""

from __future__ import annotations

import heapq

from engine.core.actions import Action, FailRequest, FinishRequest
from engine.core.chip_state import ChipState, InflightJob
from engine.core.kv import StaleJob
from engine.core.request_record import RequestRecord
from engine.core.requests import RequestState
from engine.core.retry_after import NOT_READY_RETRY_S, clamp_ms
from engine.core.sched.admission import Admission
from engine.core.sched.admission_rules import queue_wait_exceeded
from engine.core.sched.state import SchedState
from ipc.records import JobKind

S = RequestState
TRANSFERS = (JobKind.KV_EXPORT, JobKind.KV_IMPORT)


class Lifecycle:
    def __init__(self, st: SchedState, admission: Admission) -> None:
        self.st = st
        self.admission = admission

    # ------------------------------------------------------------- terminals
    def finish_now(self, r: RequestRecord, reason: str, now: float) -> list[Action]:
        """A request that ends at submit (nothing to compute): its finish, never queued."""
        self.st.counters[f"finished_{reason}"] += 1
        r.terminal_emitted = True
        return [FinishRequest(r.request_id, reason, r.usage(), r.timing(now))]

    def terminate(self, r: RequestRecord, state: RequestState) -> None:
        """Enter a terminal state (the caller emitted the terminal event) and reclaim what is not in flight."""
        assert not r.terminal_emitted, f"request {r.request_id}: second terminal event"
        st = self.st
        r.terminal_emitted = True
        old = r.state
        if old is S.WAITING_ADMISSION:
            if st.wfq.remove(r.request_id):
                self.admission.add_waiting(r, -1)
            else:
                st.requeue.remove(r.request_id)
        elif old in (S.PREFILL_READY, S.DECODE_READY):
            ch = st.chips[r.chip]
            ch.prefill.remove(r.request_id)
            ch.decode_ready.pop(r.request_id, None)
            self.admission.unbind(r, released=True)
        elif old is S.DECODE_RUNNING and st.queue_next_step and r.chip is not None:
            st.chips[r.chip].queueable.pop(r.request_id, None)  # no next step for it now
        if state is S.COMPLETED:
            r.move(S.FINISHING)
        r.move(state)
        self.forget_if_done(r)

    def terminate_running(self, r: RequestRecord, ch: ChipState, state: RequestState) -> None:
        """Terminal state for a request whose job just completed (its KV is committed; a queued next step
        still in flight keeps it bound until it drains, and its output is dropped)."""
        if r.job_id is None:
            self.admission.unbind(r, released=True)
        else:
            self.st.counters["queued_steps_past_end"] += 1
        self.terminate(r, state)

    def fail_bad_token(self, r: RequestRecord, ch: ChipState, message: str, now: float, out: list[Action]) -> None:
        """The chip returned a token (or an accepted-draft count) that cannot be: 500, not retried."""
        self.st.counters["failed_bad_token"] += 1
        out.append(FailRequest(r.request_id, 500, "bad_token", message, False, r.timing(now)))
        self.terminate_running(r, ch, S.FAILED)

    def forget_if_done(self, r: RequestRecord) -> None:
        if r.terminal and r.job_id is None and r.seq_id is None:
            self.st.requests.pop(r.request_id, None)

    def end_live(self, now: float, message: str) -> list[Action]:
        """Every live request gets 503 "shutdown" (retryable); jobs on a chip keep their KV until they drain."""
        out: list[Action] = []
        for r in list(self.st.requests.values()):
            if r.terminal:
                continue
            self.st.counters["failed_shutdown"] += 1
            out.append(FailRequest(r.request_id, 503, "shutdown", message, True, r.timing(now),
                                   retry_after_ms=clamp_ms(NOT_READY_RETRY_S)))
            self.terminate(r, S.FAILED)
        return out

    # ------------------------------------------------------------ lost lanes
    def fail_job(self, ch: ChipState, job: InflightJob, reason: str, message: str, now: float,
                 out: list[Action]) -> None:
        """Every lane of a failed job: KV Unknown (quarantined until the chip recovers), request retried or 500."""
        self.st.dirty = True
        requests = self.st.requests
        dropped = job.dropped
        for rid, seq_id in zip(job.lanes, job.seq_ids):
            if rid in dropped:
                continue  # lost with the job before it, already handled
            r = requests.get(rid)
            try:
                ch.kv.fail(seq_id, job.job_id)
            except StaleJob:
                pass
            ch.kv.release(seq_id)  # drops the UNKNOWN entry; its blocks stay quarantined until recovery
            if r is not None:
                self.lane_lost(r, reason, message, now, out)

    def lane_lost(self, r: RequestRecord, reason: str, message: str, now: float, out: list[Action]) -> None:
        """A lane of a job that will never complete (job failed, chip down): unbind; retry or fail unless ended."""
        if r.next_job is not None or self.st.queue_next_step:
            self._drop_from_other_job(r)
        r.job_id = None
        r.next_job = None
        self.admission.unbind(r, released=False)
        if r.terminal:
            self.forget_if_done(r)
        else:
            self._retry_or_fail(r, reason, message, now, out)

    def _drop_from_other_job(self, r: RequestRecord) -> None:
        """r's lane is lost: drop it from the other job that carries it (its queued next step, or the step
        that one follows), whose result then says nothing for it; its KV went with this failure."""
        ch = self.st.chips[r.chip] if r.chip is not None else None
        if ch is None:
            return
        ch.queueable.pop(r.request_id, None)
        for j in (r.job_id, r.next_job):
            other = ch.inflight.get(j) if j is not None else None
            if other is not None:
                other.dropped.add(r.request_id)

    def _retry_or_fail(self, r: RequestRecord, reason: str, message: str, now: float, out: list[Action]) -> None:
        """A request whose job was lost: requeue while nothing reached the client, else 500 (retryable elsewhere)."""
        st = self.st
        if r.emitted == 0 and r.retries < st.config.max_retries:
            r.retries += 1
            self.admission.requeue(r)
            return
        st.counters[f"failed_{reason}"] += 1
        out.append(FailRequest(r.request_id, 500, reason, message, True, r.timing(now)))
        self.terminate(r, S.FAILED)

    def chip_down(self, chip: int, now: float) -> list[Action]:
        """The chip's worker died (or hung): its jobs are lost, its lanes retried, its bound sequences requeued."""
        st = self.st
        ch = st.chips[chip]
        out: list[Action] = []
        if not ch.in_service:
            return out
        ch.in_service = False
        ch.faults += 1
        st.counters["chip_faults"] += 1
        st.dirty = True
        # a lane in a job and in its queued next step counts once; a dropped lane is not this job's any more
        inflight_lanes = list(dict.fromkeys(rid for job in ch.inflight.values() for rid in job.lanes
                                            if rid not in job.dropped))
        if st.tiers is not None:  # its transfers are lost, and blocks noted for export are gone with the chip
            st.tiers.chip_down(chip, list(ch.inflight), now)  # transfers, and prefill jobs carrying imports
            ch.kv.tier_sink.clear()
            ch.kv.cache.evict_sink.clear()
            ch.transfers = 0
        ch.inflight.clear()
        ch.queueable.clear()
        ch.kv.chip_fault()
        for rid in inflight_lanes:
            r = st.requests.get(rid)
            if r is not None:
                self.lane_lost(r, "worker_died", "the chip's worker died with this request in flight", now, out)
        # Sequences between jobs lost their KV too, but nothing was in doubt:
        # they are recomputed elsewhere from the tokens the scheduler holds.
        for rid in list(ch.bound):
            r = st.requests[rid]
            ch.prefill.remove(rid)
            ch.decode_ready.pop(rid, None)
            self.admission.unbind(r, released=False)
            self.admission.requeue(r)
        assert not ch.bound and not len(ch.prefill) and not ch.decode_ready
        return out

    # ---------------------------------------------------------------- expiry
    def expire_deadlines(self, now: float, out: list[Action]) -> None:
        st = self.st
        while st.deadlines and st.deadlines[0][0] <= now:
            t, rid = heapq.heappop(st.deadlines)
            r = st.requests.get(rid)
            if r is None or r.terminal or r.deadline != t:
                continue
            st.counters["failed_deadline_exceeded"] += 1
            out.append(FailRequest(rid, 504, "deadline_exceeded", "the request's deadline passed", False, r.timing(now)))
            self.terminate(r, S.FAILED)

    def expire_queue_waits(self, now: float, out: list[Action]) -> None:
        """admission.max_queue_wait_ms: a request still in the fair queue that long gets 429 queue_wait_exceeded
        (retryable: another board may serve it in time). Waits run out in arrival order, so only the oldest
        is looked at; a request requeued after a preemption or a fault was admitted once and is not bound."""
        st = self.st
        bound = st.budget.max_queue_wait_s
        if bound <= 0:
            return
        wfq, requests = st.wfq, st.requests
        d = None
        retry_ms = 0
        while (rid := wfq.oldest()) is not None:
            r = requests[rid]
            if r.arrival + bound > now:  # the same sum as next_wakeup's, so the wake-up at it expires it
                return
            if d is None:
                d = queue_wait_exceeded(bound, head=False)
                retry_ms = self.admission.queue_wait_retry_ms(now)
            st.counters[f"failed_{d.reason}"] += 1
            out.append(FailRequest(rid, d.code, d.reason, d.message, d.retryable, r.timing(now),
                                   retry_after_ms=retry_ms))
            self.terminate(r, S.FAILED)

    def expire_jobs(self, now: float, out: list[Action]) -> None:
        """A job past job_timeout means a hung chip: its lanes fail (KV Unknown, quarantined), then the whole
        chip goes down as on a worker death and a "chip_hung" notice asks the shell to restart the worker;
        its READY (on_chip_up) recovers the KV, so nothing waits on the quarantine forever."""
        st = self.st
        for ch in st.chips.values():
            late = [j for j in ch.inflight.values() if j.timeout_at <= now]
            if not late:
                continue
            for job in late:
                del ch.inflight[job.job_id]
                if job.kind in TRANSFERS:
                    ch.transfers -= 1
                if st.tiers is not None:  # a transfer, or a prefill job carrying imports
                    st.tiers.job_done(job.job_id, False, False, now)
                st.counters["timed_out_jobs"] += 1
                if ch.governor.on_timeout():
                    st.note_downgraded(ch)
                self.fail_job(ch, job, "job_timeout", "the chip did not answer within job_timeout", now, out)
            if ch.in_service:
                out += self.chip_down(ch.chip, now)
                st.counters["hung_chips"] += 1
                st.notices.append(("chip_hung", ch.chip, "job_timeout"))
