"""A job's result, lane by lane: KV committed, then each lane's sampled tokens as one run for `Output.accept`.

A plain decode lane's run is its one token; a multi-step job's, the lane's
row (cut at the lane's end); a verification lane's, its accepted drafts and
the token sampled after them (the rejected drafts' KV given back). A prefill
chunk that samples nothing goes back to the prefill queue.
"""

from __future__ import annotations

from engine.core.actions import Action
from engine.core.chip_state import ChipState, InflightJob
from engine.core.logprob_asks import lane_asks
from engine.core.request_record import RequestRecord
from engine.core.requests import TERMINAL_STATES, RequestState
from engine.core.sched.admission import Admission
from engine.core.sched.lifecycle import Lifecycle
from engine.core.sched.output import Output
from engine.core.sched.state import SchedState, block_end
from engine.core.stop_conditions import StopReason
from ipc.records import JobKind, JobResult

S = RequestState
_NO_LPS: tuple[float, ...] = ()


class Completion:
    def __init__(self, st: SchedState, admission: Admission, lifecycle: Lifecycle, output: Output) -> None:
        self.st = st
        self.admission = admission
        self.lifecycle = lifecycle
        self.output = output

    def complete_job(self, ch: ChipState, job: InflightJob, result: JobResult, now: float,
                     out: list[Action]) -> None:
        """A one-step job (decode, prefill, mixed, verification, a KV import)."""
        # Runs once per job; its loop once per lane, i.e. per generated token: keep the loop body lean.
        st = self.st
        requests, kv, service, accept = st.requests, ch.kv, st.tenant_service, self.output.accept
        job_id = job.job_id
        any_sampled = any(job.sampled)
        toks = result.tokens.tolist() if any_sampled else None  # Python ints once, not a numpy scalar per lane
        lps = result.logprobs
        lps = [] if lps is None or not any_sampled else lps.tolist()
        start_lens = job.start_lens
        dropped, queueable = job.dropped, ch.queueable if st.queue_next_step else None
        # alternatives ride in decode results that have them; prompt logprobs only in prefill jobs
        asks = result.top_ids is not None or job.kind is not JobKind.DECODE
        for lane, (rid, seq_id, new_len, sampled) in enumerate(zip(job.lanes, job.seq_ids, job.new_lens,
                                                                   job.sampled)):
            if dropped and rid in dropped:
                continue  # its step before failed: the lane was handled then
            r = requests[rid]
            assert r.job_id == job_id and r.seq_id == seq_id
            if job.drafts is not None and job.drafts[lane]:
                self._complete_verify(ch, job, lane, r, result, toks, lps, now, out)
                continue
            nxt = r.next_job  # a queued next step takes the lane over (KV: promoted at commit)
            r.job_id, r.next_job = nxt, None
            if queueable is not None and nxt is None:
                queueable.pop(rid, None)
            if r.state in TERMINAL_STATES:  # cancelled / expired / shut down while running: drop the output
                if len(r.tokens) >= new_len:
                    kv.commit(seq_id, job_id, r.tokens)
                    r.committed = new_len
                else:  # a queued step whose input token was never accepted: nothing of it is kept
                    kv.abandon(seq_id, job_id)
                    st.counters["queued_steps_discarded"] += 1
                if nxt is None:  # else its queued step drains first: it still writes this lane's blocks
                    self.admission.unbind(r, released=True)
                    self.lifecycle.forget_if_done(r)
                continue
            kv.commit(seq_id, job_id, r.tokens)  # holds >= new_len tokens; the KV manager reads only those
            r.committed = new_len
            service[r.params.tenant] += new_len - start_lens[lane]
            if not sampled:
                r.move(S.PREFILL_READY)
                ch.prefill.push(rid, r.prefill_target, front=True)
                r.ready_since = now
                continue
            if asks and (r.sampling[4] > 1 or r.params.prompt_logprobs is not None):  # logprobs beyond the token's
                lane_lps, ok = lane_asks(r, result, lane, lps, out)
                if not ok:
                    self.lifecycle.fail_bad_token(r, ch, "the chip returned no prompt logprobs", now, out)
                elif r.stop.exhausted():  # max_tokens 0: the prompt's logprobs were the answer
                    self.output.finish(r, StopReason.LENGTH, now, out)
                else:
                    accept(r, ch, toks, lane_lps, lane, lane + 1, now, out)
                continue
            accept(r, ch, toks, lps, lane, lane + 1, now, out)  # the lane's run: its one token

    def _complete_verify(self, ch: ChipState, job: InflightJob, lane: int, r: RequestRecord, result: JobResult,
                         toks: list[int] | None, lps: list[float], now: float, out: list[Action]) -> None:
        """A lane that carried drafts: commit the accepted run, give back the rest, emit token by token."""
        st = self.st
        drafts = job.drafts[lane] if job.drafts is not None else []
        n_drafted = len(drafts)
        acc = result.accepted
        a = int(acc[lane]) if acc is not None and len(acc) > lane else -1
        start = job.start_lens[lane]
        r.job_id = None
        at = int(acc[:lane].sum()) if a >= 0 else 0
        if job.model_drafts is not None and job.model_drafts[lane] and 0 <= a <= len(drafts):
            got = result.accepted_tokens  # the draft model's proposals: the scheduler sent placeholders
            drafts = got[at:at + a].tolist() if got is not None and len(got) >= at + a else []
            if len(drafts) != a:
                a = -1
        if not 0 <= a <= len(drafts) or toks is None:
            ch.kv.commit(r.seq_id, job.job_id, r.tokens, upto=start + 1)  # the last token's KV is sound
            r.committed = start + 1
            if r.state in TERMINAL_STATES:
                self.admission.unbind(r, released=True)
                self.lifecycle.forget_if_done(r)
                return
            self.lifecycle.fail_bad_token(r, ch, f"the chip accepted {a} of {n_drafted} drafts", now, out)
            return
        new_len = start + 1 + a
        ch.kv.commit(r.seq_id, job.job_id, r.tokens + drafts[:a], upto=new_len)
        r.committed = new_len
        st.tenant_service[r.params.tenant] += new_len - start
        if r.state in TERMINAL_STATES:
            self.admission.unbind(r, released=True)
            self.lifecycle.forget_if_done(r)
            return
        # rejected drafts' KV: keep only the room a plain decode step would hold (the next position's block)
        keep = block_end(new_len + 1, ch.block_size, st.model.max_seq)
        if keep < r.reserved:
            ch.kv.rollback_tail(r.seq_id, keep)
            st.kv_reserved -= r.reserved - keep
            r.reserved = keep
        st.spec.observe(r, n_drafted, a)
        run = drafts[:a] + [toks[lane]]
        acc_lps = result.accepted_logprobs
        if r.params.logprobs and acc_lps is not None:
            run_lps = acc_lps[at:at + a].tolist() + [lps[lane] if len(lps) > lane else 0.0]
        else:
            run_lps = [0.0] * len(run)
        self.output.accept(r, ch, run, run_lps, 0, len(run), now, out)

    def complete_steps(self, ch: ChipState, job: InflightJob, result: JobResult, now: float,
                       out: list[Action]) -> None:
        """A multi-step decode job: each lane's row of tokens, kept up to the lane's end (the rest dropped)."""
        st = self.st
        requests, kv, job_id, accept = st.requests, ch.kv, job.job_id, self.output.accept
        rows = result.tokens.tolist()
        lps = result.logprobs.tolist() if result.logprobs is not None and result.logprobs.ndim == 2 else None
        n = job.steps
        for lane, (rid, seq_id, new_len, start) in enumerate(zip(job.lanes, job.seq_ids, job.new_lens,
                                                                 job.start_lens)):
            if rid in job.dropped:
                continue
            r = requests[rid]
            assert r.job_id == job_id and r.seq_id == seq_id
            r.job_id = None
            if r.state in TERMINAL_STATES:
                kv.abandon(seq_id, job_id)
                self.admission.unbind(r, released=True)
                self.lifecycle.forget_if_done(r)
                continue
            row = rows[lane]
            # the KV of steps 2..n was computed from this row's first n-1 tokens: valid for them
            kv.commit(seq_id, job_id, r.tokens + row[:n - 1])
            r.committed = new_len
            st.tenant_service[r.params.tenant] += new_len - start
            k = accept(r, ch, row, lps[lane] if lps else _NO_LPS, 0, n, now, out)
            if k < n:  # a stop at row[k]: the tokens after it were sampled past the lane's end
                st.counters["multi_step_tokens_dropped"] += n - 1 - k
