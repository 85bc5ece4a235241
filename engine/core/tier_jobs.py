"""The scheduler's KV-tier jobs: KV_EXPORT and KV_IMPORT submitted, and their results taken back.

`tier_transfers.KvTiers` decides what moves between a chip and the host/disk
tiers; this is the scheduler's side of it: exports go out as one job ahead
of any job that could overwrite their blocks, imports planned at admission
go out at the next tick, and an import's result is completed like a prefill
chunk (a refused one is recomputed).
"""

from __future__ import annotations

from engine.core.actions import Action, SubmitJob
from engine.core.chip_state import ChipState, InflightJob
from engine.core.requests import TERMINAL_STATES, RequestState
from engine.core.sched.admission import Admission
from engine.core.sched.completion import Completion
from engine.core.sched.lifecycle import Lifecycle
from engine.core.sched.state import SchedState
from ipc.records import JobKind, JobResult, JobStatus

S = RequestState


class TierJobs:
    def __init__(self, st: SchedState, admission: Admission, lifecycle: Lifecycle, completion: Completion) -> None:
        self.st = st
        self.admission = admission
        self.lifecycle = lifecycle
        self.completion = completion

    def flush_exports(self, ch: ChipState, now: float, out: list[Action]) -> None:
        """Queue the chip's pending exports as one KV_EXPORT job, ahead of any job that could overwrite them."""
        st = self.st
        tiers = st.tiers
        tiers.collect(ch.chip, ch.kv)
        if not ch.in_service:
            return
        job_id = next(st.job_ids)
        job = tiers.export_job(ch.chip, job_id, st.model.generation, now)
        if job is None:
            return
        self._submit(ch, job, [], [], [], [], now, out)

    def _submit(self, ch: ChipState, job, lanes: list[int], seq_ids: list[int], starts: list[int],
                ends: list[int], now: float, out: list[Action]) -> None:
        st = self.st
        ch.inflight[job.job_id] = InflightJob(
            job_id=job.job_id, kind=job.kind, lanes=lanes, seq_ids=seq_ids, start_lens=starts, new_lens=ends,
            sampled=[False] * len(lanes), batch=len(lanes), submitted_at=now,
            timeout_at=now + st.config.job_timeout_s)
        ch.transfers += 1
        st.counters[f"{job.kind.name.lower()}_jobs"] += 1
        out.append(SubmitJob(ch.chip, job, lanes))

    def launch_transfers(self, now: float, out: list[Action]) -> None:
        """Every chip's exports, then the imports planned at admission (an import may reuse an exported block)."""
        st = self.st
        for ch in st.chips.values():
            self.flush_exports(ch, now, out)
        imports, st.imports = st.imports, []
        for chip, rid, plan in imports:
            ch = st.chips[chip]
            r = st.requests[rid]
            bs = ch.block_size
            first = r.committed // bs
            end = r.committed + plan.blocks * bs
            job_id = next(st.job_ids)
            job = st.tiers.import_job(chip, job_id, st.model.generation, plan,
                                      ch.kv.block_table_view(r.seq_id)[first:first + plan.blocks], now)
            ch.kv.begin_update(r.seq_id, job_id, end)
            r.job_id = job_id
            r.move(S.PREFILL_RUNNING)
            if r.t_first_sched is None:
                r.t_first_sched = now
            ch.release_freed(out)  # before the import: it may write a freed block
            self._submit(ch, job, [rid], [r.seq_id], [r.committed], [end], now, out)

    def transfer_result(self, ch: ChipState, job: InflightJob, result: JobResult, now: float,
                        out: list[Action]) -> None:
        st = self.st
        ch.transfers -= 1
        fresh = result.generation == st.model.generation and result.kind == job.kind
        ok = fresh and result.status == JobStatus.OK
        refused = fresh and result.status == JobStatus.INVALID
        st.tiers.job_done(job.job_id, ok, refused, now)
        if job.kind is JobKind.KV_EXPORT:
            return
        if ok:
            self.completion.complete_job(ch, job, result, now, out)  # the imported tokens are committed; prefill next
            return
        if not refused:
            self.lifecycle.fail_job(ch, job, "job_failed", "a KV import failed", now, out)
            return
        # Refused whole before any write: the blocks hold what they held; recompute those tokens.
        st.counters["tier_refused_imports"] += 1
        for rid, seq_id in zip(job.lanes, job.seq_ids):
            r = st.requests[rid]
            ch.kv.abort_update(seq_id, job.job_id)
            r.job_id = None
            if r.state in TERMINAL_STATES:
                self.admission.unbind(r, released=True)
                self.lifecycle.forget_if_done(r)
                continue
            r.move(S.PREFILL_READY)
            ch.prefill.push(rid, r.prefill_target - r.committed, front=True)
            r.ready_since = now
