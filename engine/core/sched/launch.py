"""A plan becomes a job: its lanes, the record, the requests' moves to running, the job in flight, the actions.

`Launcher.launch` is the one place a planned job's requests move to
PREFILL_RUNNING / DECODE_RUNNING and their KV sequences begin the job's
update (or, with queued next steps, queue it behind the running one):
`_record` builds what the chip runs, `_start` moves the requests.
"""

from __future__ import annotations

from engine.core.actions import Action, SubmitJob
from engine.core.chip_state import ChipState, InflightJob
from engine.core.constraint_spec import lane_fields
from engine.core.logprob_asks import prompt_lane_want
from engine.core.penalty_spec import lane_penalty
from engine.core.lora.job_adapters import adapter_field
from engine.core.request_record import RequestRecord
from engine.core.requests import RequestState
from engine.core.sched.job_builder import JobPlan
from engine.core.sched.state import SchedState
from engine.core.tier_jobs import TierJobs
from ipc.records import QUEUED_STEP_TOKEN, Job, JobKind, Lane, build_job, decode_job

S = RequestState
_QUEUED_STEP_TOKENS = (QUEUED_STEP_TOKEN,)  # a queued next step's input token: the one the lane's running job samples
_NO_CONSTRAINT: dict = {}  # the lane fields of an unconstrained request


class Launcher:
    def __init__(self, st: SchedState, tier_jobs: TierJobs) -> None:
        self.st = st
        self.tier_jobs = tier_jobs

    def launch(self, ch: ChipState, plan: JobPlan, now: float, out: list[Action]) -> None:
        """The tail every job shares: its lanes (decode lanes first, one token each, then the prompt chunks),
        the record, the requests' moves, the job in flight, then release notices and the job itself."""
        st = self.st
        kind, decode, prompts, batch, steps, drafts, model_drafts = plan
        if st.lane_imports and prompts:  # a prompt's pending tier import rides in this job: chunks start after it
            prompts = self.tier_jobs.after_imports(ch, prompts)
        job_id = next(st.job_ids)
        rs = decode + [r for r, _, _ in prompts]
        # a decode lane whose job is still running gets its next step queued: one position further on
        queued = [r.job_id is not None for r in decode] if st.queue_next_step else None
        starts = [r.committed for r in decode] if queued is None else \
            [r.committed + q for r, q in zip(decode, queued)]
        ends = [s + steps for s in starts]
        starts += [start for _, start, _ in prompts]
        ends += [end for _, _, end in prompts]
        sampled = [True] * len(decode) + [end == r.prefill_target for r, _, end in prompts]
        if drafts is not None:  # a verification job: a prefill-like chunk per speculating lane
            drafts = drafts + [[]] * len(prompts)
            model_drafts = model_drafts + [False] * len(prompts) if model_drafts is not None else None
            ends = [e + len(ds) for e, ds in zip(ends, drafts)]
        job = self._record(ch, plan, job_id, rs, starts, ends, sampled, queued, drafts, model_drafts)
        if st.lane_imports and prompts:
            self.tier_jobs.attach_imports(ch, job, rs, len(decode), now)
        if st.model.lora_slots:
            adapters = adapter_field(rs, job.batch)
            if adapters is not None:
                job.adapter = adapters
        self._start(ch, plan, job_id, rs, ends, queued, drafts, now)
        lanes = [r.request_id for r in rs]
        ch.inflight[job_id] = InflightJob(
            job_id=job_id, kind=kind, lanes=lanes, seq_ids=[r.seq_id for r in rs],
            start_lens=starts, new_lens=ends, sampled=sampled, batch=len(rs) if batch is None else batch,
            submitted_at=now, timeout_at=now + st.config.job_timeout_s, steps=steps,
            drafts=drafts, model_drafts=model_drafts,
        )
        ch.jobs_submitted += 1
        if steps > 1:
            st.counters["multi_step_jobs"] += 1
        if st.tiers is not None:
            self.tier_jobs.flush_exports(ch, now, out)  # before the job: it may overwrite a block being exported
        ch.release_freed(out)  # before the job: it may reuse a freed block
        out.append(SubmitJob(ch.chip, job, lanes))

    def _record(self, ch: ChipState, plan: JobPlan, job_id: int, rs: list[RequestRecord], starts: list[int],
                ends: list[int], sampled: list[bool], queued: list[bool] | None, drafts: list[list[int]] | None,
                model_drafts: list[bool] | None) -> Job:
        """The job record the chip runs."""
        st = self.st
        kind, decode, batch, steps, queue_next_step = plan.kind, plan.decode, plan.batch, plan.steps, st.queue_next_step
        queuing = queued is not None and any(queued)
        if drafts is None and kind is JobKind.DECODE and not any(r.params.host_stepped for r in decode):
            # the common job, one per decode step: packed from columns, no Lane per lane
            toks = [r.tokens[s] for r, s in zip(decode, starts)] if not queuing else \
                [QUEUED_STEP_TOKEN if q else r.tokens[s] for r, s, q in zip(decode, starts, queued)]
            view = ch.kv.block_table_view  # not copied: decode_job copies the tables before the KV changes again
            return decode_job(toks, starts, [view(r.seq_id) for r in decode], [r.sampling for r in decode],
                              job_id=job_id, generation=st.model.generation, batch=batch,
                              table_width=ch.max_blocks_per_seq, decode_steps=steps, queue_next_step=queue_next_step)
        lane = self._lane
        if drafts is None:
            lanes_in = [lane(r, ch, s, e, smp) for r, s, e, smp in zip(rs, starts, ends, sampled)]
            if queuing:
                lanes_in = [ln._replace(tokens=_QUEUED_STEP_TOKENS) if i < len(queued) and queued[i] else ln
                            for i, ln in enumerate(lanes_in)]
        else:  # one lane per request: the speculating lanes' last token and drafts, the others as planned
            lanes_in = [lane(r, ch, s, e, smp, ds, bool(model_drafts and model_drafts[i]))
                        for i, (r, s, e, smp, ds) in enumerate(zip(rs, starts, ends, sampled, drafts))]
        return build_job(kind, lanes_in, job_id=job_id, generation=st.model.generation, batch=batch,
                         table_width=ch.max_blocks_per_seq, decode_steps=steps, queue_next_step=queue_next_step)

    def _start(self, ch: ChipState, plan: JobPlan, job_id: int, rs: list[RequestRecord], ends: list[int],
               queued: list[bool] | None, drafts: list[list[int]] | None, now: float) -> None:
        """The requests' moves: each lane's KV begins the job's update (or queues it behind the running job)
        and the request is running."""
        st, kv, decode = self.st, ch.kv, plan.decode
        turns = st.turns
        for r in decode:  # to the back of the round robin, in the job's lane order (decode_candidates)
            r.decode_key = (r.decode_key[0], next(turns))
        ready = ch.decode_ready
        if queued is None:
            for r, end in zip(rs, ends):
                kv.begin_update(r.seq_id, job_id, end)
                r.job_id = job_id
            for r in decode:
                del ready[r.request_id]
                r.move(S.DECODE_RUNNING)
        else:
            queueable = ch.queueable
            for i, r in enumerate(decode):
                rid = r.request_id
                if queued[i]:  # the queued step: this job takes the lane when the running one commits
                    kv.queue_next_step(r.seq_id, job_id, ends[i])
                    r.next_job = job_id
                    del queueable[rid]
                    st.counters["queued_steps"] += 1
                else:
                    kv.begin_update(r.seq_id, job_id, ends[i])
                    r.job_id = job_id
                    del ready[rid]
                    r.move(S.DECODE_RUNNING)
                    if plan.steps == 1 and drafts is None:
                        ch.may_queue_step(r)
            for r, end in zip(rs[len(decode):], ends[len(decode):]):
                kv.begin_update(r.seq_id, job_id, end)
                r.job_id = job_id
        for r, _, _ in plan.prompts:
            r.move(S.PREFILL_RUNNING)
            if r.t_first_sched is None:
                r.t_first_sched = now

    @staticmethod
    def _lane(r: RequestRecord, ch: ChipState, start: int, end: int, sample: bool,
              drafts: list[int] | None = None, draft_model: bool = False) -> Lane:
        """The one place a request becomes a job lane (per-lane inputs the chip needs go here)."""
        p = r.params
        want = r.sampling[4] if p.prompt_logprobs is None else prompt_lane_want(r, start, sample)
        if not p.host_stepped and not drafts:  # the common lane, positionally (one per generated token)
            return Lane(r.tokens[start:end], start, ch.kv.block_table_view(r.seq_id), sample, p.temperature,
                        p.top_p, p.top_k, p.seed, want)
        # block_table_view: not copied, build_job copies it into the record before the KV changes again
        return Lane(
            tokens=r.tokens[start:end] if not drafts else r.tokens[start:start + 1] + drafts, start=start,
            block_table=ch.kv.block_table_view(r.seq_id), sample=sample,
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed, want_logprobs=want,
            drafts=len(drafts) if drafts else 0, draft_model=draft_model,
            **(_NO_CONSTRAINT if p.constraint is None else  # a drafted lane's output count: up to its real token
               lane_fields(p.constraint, r.request_id, r.tokens, len(p.prompt), start + 1 if drafts else end,
                           r.prefill_target)),
            penalty=None if p.penalties is None or not sample else
            lane_penalty(p.penalties, r.request_id, r.tokens, len(p.prompt), min(end, len(r.tokens)),
                         r.prefill_target, r.stop.eos_ids | r.stop.stop_token_ids),  # a multi-step job's end: ahead
        )
