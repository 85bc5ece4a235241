"""Choices of an `n` > 1 request forked by copying their leader's KV on the device, not recomputing the prompt.

A choice released after its leader computed the prompt (engine/core/sched/
choices.py) is admitted like any request: the prompt's full blocks are the
leader's, found in the prefix cache. What is left of its prompt, the tokens
of the partial last block (every token's block without the prefix cache),
is then not computed again: one KV_COPY job copies the leader's blocks that
hold positions committed..L-2 into the choice's fresh blocks (the choices
admitted together share one job), and the choice decodes straight away. Its
first step feeds the prompt's last token at position L-1, whose logits are
the prefill's last row, and sampling is a function of (seed, position), so
it samples what a prefill would have.

This needs the leader still holding that KV on the same chip (it decodes),
and a backend that runs the copy (`ModelSpec.kv_copy`; llama.cpp runs it as
a sequence fork, its cells shared): otherwise the choice recomputes those
tokens as a prefill, as before. A copy that fails loses its lanes like any
failed job (the choices are retried, and then recompute their prompt).
"""

from __future__ import annotations

from engine.core.actions import Action, SubmitJob
from engine.core.chip_state import ChipState, InflightJob
from engine.core.request_record import RequestRecord
from engine.core.requests import RequestState
from engine.core.sched.admission import Admission
from engine.core.sched.lifecycle import Lifecycle
from engine.core.sched.state import SchedState
from ipc.records import Job, JobKind, JobResult, JobStatus

S = RequestState
_LEADER_HOLDS_PROMPT = frozenset({S.DECODE_READY, S.DECODE_RUNNING})


class ChoiceForks:
    def __init__(self, st: SchedState, admission: Admission, lifecycle: Lifecycle) -> None:
        self.st = st
        self.admission = admission
        self.lifecycle = lifecycle
        self._leader_of: dict[int, int] = {}  # released choice not admitted yet -> its leader

    def released(self, leader: int, rid: int) -> None:
        """Choice `rid` was submitted: fork it from `leader` once it is admitted (if the backend copies)."""
        if self.st.model.kv_copy and rid in self.st.requests:
            self._leader_of[rid] = leader

    def launch(self, now: float, out: list[Action]) -> None:
        """After admission: each choice admitted since takes its leader's KV, or recomputes. The copies of one
        chip go as one KV_COPY job (one round trip however many choices)."""
        if not self._leader_of:
            return
        st = self.st
        copies: dict[int, list[tuple[RequestRecord, list[int], list[int], int, int]]] = {}
        for rid, leader in list(self._leader_of.items()):
            r = st.requests.get(rid)
            if r is not None and not r.terminal and r.state is S.WAITING_ADMISSION:
                continue  # not admitted yet
            del self._leader_of[rid]
            if r is not None and r.state is S.PREFILL_READY and r.job_id is None:
                self._fork(r, st.requests.get(leader), now, copies)
        for chip, todo in copies.items():
            self._submit(st.chips[chip], todo, now, out)

    def _fork(self, r: RequestRecord, lead: RequestRecord | None, now: float,
              copies: dict[int, list[tuple[RequestRecord, list[int], list[int], int, int]]]) -> None:
        st = self.st
        n = r.prefill_target
        if lead is None or lead.state not in _LEADER_HOLDS_PROMPT or lead.chip != r.chip \
                or lead.seq_id is None or lead.committed < n - 1 or lead.tokens[:n] != r.tokens[:n]:
            st.counters["choices_recomputed"] += 1
            return
        ch = st.chips[r.chip]
        if not ch.in_service:
            return
        start, end = r.committed, n - 1  # start: the prefix-cache hit, whole blocks; end: what decode feeds
        ch.prefill.remove(r.request_id)
        plan = st.lane_imports.pop(r.request_id, None) if st.lane_imports else None
        if plan is not None:  # a tier promotion its prefill job would have carried: the leader's copy covers it
            st.tiers.drop_plan(plan)
        r.move(S.PREFILL_RUNNING)
        if r.t_first_sched is None:
            r.t_first_sched = now
        st.counters["choices_kv_forked"] += 1
        if start == end:  # the hit covers every position before the last: nothing to copy
            self._to_decode(ch, r, now)
            return
        bs = ch.block_size
        first, last = start // bs, (end - 1) // bs + 1
        src = list(ch.kv.block_table_view(lead.seq_id)[first:last])
        dst = list(ch.kv.block_table_view(r.seq_id)[first:last])
        copies.setdefault(ch.chip, []).append((r, src, dst, start, end))

    def _submit(self, ch: ChipState, todo: list[tuple[RequestRecord, list[int], list[int], int, int]], now: float,
                out: list[Action]) -> None:
        st = self.st
        job_id = next(st.job_ids)
        src = [b for _, s, _, _, _ in todo for b in s]
        dst = [b for _, _, d, _, _ in todo for b in d]
        for r, _, _, _, end in todo:
            ch.kv.begin_update(r.seq_id, job_id, end)
            r.job_id = job_id
        lanes = [r.request_id for r, *_ in todo]
        ch.inflight[job_id] = InflightJob(
            job_id=job_id, kind=JobKind.KV_COPY, lanes=lanes, seq_ids=[r.seq_id for r, *_ in todo],
            start_lens=[t[3] for t in todo], new_lens=[t[4] for t in todo], sampled=[False] * len(todo),
            batch=len(todo), submitted_at=now, timeout_at=now + st.config.job_timeout_s)
        st.counters["choices_kv_copy_blocks"] += len(src)
        st.counters["choices_kv_copy_jobs"] += 1
        ch.release_freed(out)  # before the copy: it may write a block freed just now
        out.append(SubmitJob(ch.chip, Job.kv_copy(job_id, st.model.generation, src, dst), lanes))

    def result(self, ch: ChipState, job: InflightJob, result: JobResult, now: float, out: list[Action]) -> None:
        """A KV_COPY of choices answered: their prompts' KV is whole, they decode next (or the lanes are lost)."""
        st = self.st
        if result.generation != st.model.generation or result.kind != job.kind or result.status != JobStatus.OK:
            st.counters["choices_kv_copy_failed"] += 1
            self.lifecycle.fail_job(ch, job, "job_failed", "copying the leader's KV failed", now, out)
            return
        for rid, seq_id, new_len in zip(job.lanes, job.seq_ids, job.new_lens):
            r = st.requests[rid]
            ch.kv.commit(seq_id, job.job_id, r.tokens)
            r.committed = new_len
            r.job_id = None
            if r.terminal:  # cancelled or expired while copying
                self.admission.unbind(r, released=True)
                self.lifecycle.forget_if_done(r)
                continue
            self._to_decode(ch, r, now)

    def _to_decode(self, ch: ChipState, r: RequestRecord, now: float) -> None:
        r.move(S.DECODE_READY)
        r.ready_since = now
        ch.decode_ready[r.request_id] = None
