"""The scheduler's KV-tier jobs: KV_EXPORT and KV_IMPORT submitted, and their results taken back.

`tier_transfers.KvTiers` decides what moves between a chip and the host/disk
tiers; this is the scheduler's side of it: exports go out as one job ahead
of any job that could overwrite their blocks, imports planned at admission
go out at the next tick, and an import's result is completed like a prefill
chunk (a refused one is recomputed).

When the workers run imports carried in a prefill job (`ModelSpec.lane_imports`),
an import planned at admission goes out instead in the request's first
prefill job (`after_imports`, `attach_imports`): the chunk starts after the
imported tokens, and the job's lane depends on the imported blocks. A lane
whose import the worker refused was not run and wrote nothing: its prompt is
recomputed from what the chip holds, and the job's other lanes complete as
usual (`lane_imports_result`). Recompute, not an error: a tier is a cache, and
a bad entry in it must cost time, never a request.
"""

from __future__ import annotations

from engine.core.actions import Action, SubmitJob
from engine.core.chip_state import ChipState, InflightJob
from engine.core.requests import TERMINAL_STATES, RequestState
from engine.core.sched.admission import Admission
from engine.core.sched.completion import Completion
from engine.core.sched.lifecycle import Lifecycle
from engine.core.batch_planner import PromptChunk
from engine.core.request_record import RequestRecord
from engine.core.sched.state import SchedState
from ipc.lane_imports import LaneImports
from ipc.records import Job, JobKind, JobResult, JobStatus

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

    # -- imports carried in prefill jobs -------------------------------------------------
    def after_imports(self, ch: ChipState, prompts: list[PromptChunk]) -> list[PromptChunk]:
        """The chunks, each of a request with an import pending starting after the imported tokens."""
        pending = self.st.lane_imports
        out = []
        for r, start, end in prompts:
            plan = pending.get(r.request_id)
            if plan is not None:
                assert start == r.committed
                start = r.committed + plan.blocks * ch.block_size
                end = min(r.prefill_target, start + (end - r.committed))
            out.append((r, start, end))
        return out

    def attach_imports(self, ch: ChipState, job: Job, rs: list[RequestRecord], first_prompt: int,
                       now: float) -> None:
        """Put the pending imports of the job's prompt lanes (from lane `first_prompt` on) into the job."""
        st = self.st
        bs = ch.block_size
        parts = []
        for lane in range(first_prompt, len(rs)):
            r = rs[lane]
            plan = st.lane_imports.pop(r.request_id, None)
            if plan is None:
                continue
            first = r.committed // bs
            dst = ch.kv.block_table_view(r.seq_id)[first:first + plan.blocks]
            parts.append(st.tiers.lane_import(ch.chip, job.job_id, r.request_id, lane, plan, dst, now))
        if parts:
            job.imports = LaneImports.concat(parts)
            st.counters["lane_import_jobs"] += 1

    def lane_imports_result(self, ch: ChipState, job: InflightJob, result: JobResult, now: float,
                            out: list[Action]) -> bool:
        """The imports of a prefill job that carried some; its refused lanes go back to be recomputed (and are
        dropped from the job). True when the whole job was handled here (a worker that ignored them)."""
        st = self.st
        tiers = st.tiers
        ok = (result.generation == st.model.generation and result.kind == job.kind
              and result.status == JobStatus.OK and result.tokens.shape[0] == job.batch)
        refused = result.refused if ok else None
        if ok and (refused is None or refused.shape[0] != job.batch):
            # the imports were not run, so the prefill read blocks nobody wrote: nothing of the job is sound
            tiers.job_done(job.job_id, False, False, now)
            st.counters["failed_jobs"] += 1
            self.lifecycle.fail_job(ch, job, "job_invalid", "the chip ran a prefill without its KV imports",
                                    now, out)
            return True
        if not ok:  # lost, failed or stale: its lanes are failed by the caller, the entries unpinned here
            tiers.job_done(job.job_id, False, False, now)
            return False
        for lane, (rid, seq_id) in enumerate(zip(job.lanes, job.seq_ids)):
            if not refused[lane]:
                tiers.lane_import_done(job.job_id, rid, True, False, now)
                continue
            tiers.lane_import_done(job.job_id, rid, False, True, now)
            st.counters["tier_refused_imports"] += 1
            job.dropped.add(rid)  # the job's result says nothing for it
            self._recompute(ch, job.job_id, rid, seq_id, now)
        return False

    def _recompute(self, ch: ChipState, job_id: int, rid: int, seq_id: int, now: float) -> None:
        """A lane whose import was refused whole (nothing written): the KV holds what it held; the tokens
        after it are computed again (or, the request having ended meanwhile, its KV is released)."""
        r = self.st.requests[rid]
        ch.kv.abort_update(seq_id, job_id)
        r.job_id = None
        if r.state in TERMINAL_STATES:
            self.admission.unbind(r, released=True)
            self.lifecycle.forget_if_done(r)
            return
        r.move(S.PREFILL_READY)
        ch.prefill.push(rid, r.prefill_target - r.committed, front=True)
        r.ready_since = now

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
            self._recompute(ch, job.job_id, rid, seq_id, now)
