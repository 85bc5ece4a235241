"""Which job a chip runs next, as a plan: decode lanes, prompt chunks, profile, steps and drafts.

`JobBuilder.plans(ch, now)` fills the chip's free job slots: it picks decode
or a prefill class by weighted round robin (or, with mixed batches, decode
lanes and prompt chunks within one token budget), makes KV room for the
lanes it picks (`grow_to`, preempting the youngest idle sequence when a
decode lane has none), and yields one `JobPlan` per job; the caller launches
each before the next is planned (`Launcher.launch`), so every plan sees what
the jobs before it took. Which lanes and chunks: `BatchPlanner`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import NamedTuple

from engine.core.batch_planner import PromptChunk
from engine.core.chip_state import ChipState
from engine.core.logprob_asks import whole_prompt
from engine.core.lora.job_lanes import AdapterLanes
from engine.core.prefill_queues import WorkClass
from engine.core.request_record import RequestRecord
from engine.core.requests import RequestState
from engine.core.sched.admission import Admission
from engine.core.sched.state import SchedState, block_end
from engine.core.spec.planner import draft_room
from ipc.records import JobKind


class JobPlan(NamedTuple):
    kind: JobKind
    decode: list[RequestRecord]  # decode lanes, one token each (`steps` with multi-step), in lane order
    prompts: list[PromptChunk]  # (request, start, end) chunks after the decode lanes
    batch: int | None  # the compiled decode profile; None: one lane per request
    steps: int = 1  # decode steps the worker runs (multi-step decode)
    drafts: list[list[int]] | None = None  # per decode lane: draft tokens to verify (a verification job)
    model_drafts: list[bool] | None = None  # per decode lane: the draft model fills them (placeholders sent)


class JobBuilder:
    def __init__(self, st: SchedState, admission: Admission) -> None:
        self.st = st
        self.admission = admission
        self.adapters = AdapterLanes()  # LoRA: which lanes a job may take (engine/core/lora/job_lanes.py)

    def plans(self, ch: ChipState, now: float) -> Iterator[JobPlan]:
        """The chip's next jobs while it has free slots; launch each before asking for the next."""
        st = self.st
        budget = st.planner.mixed_budget
        if budget:
            while ch.in_service and len(ch.inflight) - ch.transfers < ch.governor.limit():
                plan = self._mixed(ch, budget, now)
                if plan is None:
                    return
                yield plan
            return
        limit = ch.governor.limit()
        decode_failed = False  # no decode job could go this time (no KV room): the slot goes to prompts
        while ch.in_service:
            n = len(ch.inflight) - ch.transfers
            # With queued next steps the chip takes one job past the limit while a running lane may
            # get a queued step: its next step, or a prompt's job in its place (the chip then runs that instead).
            if n >= limit and not (n == limit and st.queue_next_step and ch.queueable):
                return
            classes = ch.prefill.nonempty()
            if not decode_failed and ((st.queue_next_step and ch.queueable) or (
                    ch.decode_ready and self._may_fire(st.planner.decode_hold(ch.decode_ready, st.requests, now)))):
                classes.append(WorkClass.DECODE)
            cls = ch.wrr.pick(classes)
            if cls is None:
                return
            if cls is WorkClass.DECODE:
                plan = self._decode(ch, now)
                decode_failed = plan is None
                if plan is not None:
                    yield plan
            else:
                yield self._prefill(ch, ch.prefill.pop(cls))

    def _may_fire(self, hold_until: float | None) -> bool:
        """A window's verdict (None: go now); a held job notes when to look again."""
        if hold_until is None:
            return True
        wake = self.st.window_wakeup
        self.st.window_wakeup = hold_until if wake is None else min(wake, hold_until)
        return False

    # ------------------------------------------------------------------ jobs
    def _decode(self, ch: ChipState, now: float) -> JobPlan | None:
        """One decode job; None when none could go. With queued next steps, the lanes running now that may
        get a queued step are candidates beside the ready ones."""
        st = self.st
        plan = st.planner
        pool: Collection[int] = ch.decode_ready
        if st.queue_next_step and ch.queueable:
            pool = {**ch.decode_ready, **ch.queueable}
        cands = plan.decode_candidates(pool, st.requests)
        chosen = self._with_room(ch, plan.pick_lanes(cands, plan.decode_profile(len(cands))))
        if st.model.lora_slots:  # lanes of more adapters than the chip holds (or of another group) wait
            chosen = self.adapters.decode(st.model, ch.chip, chosen)
        if not chosen:
            return None
        batch = plan.fitting_profile(len(chosen))
        st.job_counts.decode_job(batch, len(chosen))
        steps = self._steps_for(ch, chosen, now) if st.config.decode_steps > 1 else 1
        return self._plan(ch, JobKind.DECODE, chosen, [], batch, steps)

    def _prefill(self, ch: ChipState, rid: int) -> JobPlan:
        st = self.st
        r = st.requests[rid]
        start = r.committed
        end = r.prefill_target if whole_prompt(r) else st.planner.prefill_end(start, r.prefill_target)
        st.job_counts.prefill_job(end - start)
        if st.model.lora_slots:
            self.adapters.prefill(st.model, ch.chip, r)
        return self._plan(ch, JobKind.PREFILL, [], [(r, start, end)], None)

    def _mixed(self, ch: ChipState, budget: int, now: float) -> JobPlan | None:
        """One job of the ready decode lanes plus prompt chunks, `budget` tokens in all; None when idle.

        Mixed batches (vLLM's token budget, llama.cpp's server loop): decode
        lanes ride along with every job, so a prompt burst does not stall
        the streams already generating, and several prompts share one pass
        over the weights. Which lanes and chunks: `BatchPlanner.take_prompts`.
        With `decode_steps` > 1 and no prompt waiting, the lanes go as a
        multi-step decode job instead, while the batch is stable (`_steps_for`).
        """
        st = self.st
        plan, requests = st.planner, st.requests
        decode: list[RequestRecord] = []
        lora = st.model.lora_slots
        if lora:
            self.adapters.begin_mixed(st.model, ch.chip)
        waiting = len(ch.prefill)
        if waiting and plan.burst_budget > budget:
            budget = plan.job_budget((ch.decode_ready, *(j.lanes for j in ch.inflight.values())), requests)
        if waiting and not ch.decode_ready:
            if not self._may_fire(plan.prompts_hold(ch.prefill, requests, budget, now)):
                return None
        if ch.decode_ready and (waiting or self._may_fire(plan.decode_hold(ch.decode_ready, requests, now))):
            cands = plan.decode_candidates(ch.decode_ready, requests)
            decode = self._with_room(ch, plan.mixed_decode_lanes(cands, budget, bool(waiting)))
            if lora:
                decode = self.adapters.decode(st.model, ch.chip, decode, mixed_job=True)
            if decode and not waiting and st.config.decode_steps > 1:
                steps = self._steps_for(ch, decode, now)
                if steps > 1:  # else a one-step mixed job, and the next prompt to arrive rides in one again
                    if lora:
                        self.adapters.end_mixed(st.model, ch.chip, decode, [])
                    batch = plan.fitting_profile(len(decode))
                    st.job_counts.decode_job(batch, len(decode))
                    return self._plan(ch, JobKind.DECODE, decode, [], batch, steps)
        # A burst's job (no stream past its first token anywhere on the chip) takes whole prompts beyond the
        # cap: the lanes it carries wait for the burst as llama.cpp's first slots do, and then every stream
        # steps together; its prompt chunks stay within the cap (`burst_chunk_room`).
        bursting = budget > plan.mixed_budget
        decoding = not bursting and (bool(decode) or self._decoding(ch))
        left = budget - len(decode)
        room = plan.prompt_room(left, decoding)
        prompts, left = plan.take_prompts(ch.prefill, ch.wrr, requests, room, plan.capped(left, decoding),
                                          plan.burst_chunk_room(bursting), bool(decode))
        if lora:
            if prompts:
                prompts, put_back = self.adapters.prompts(st.model, ch.prefill, decode, prompts)
                left += put_back
            if self.adapters.end_mixed(st.model, ch.chip, decode, prompts):
                return self._mixed(ch, budget, now)  # the overdue adapter had nothing here: plan freely
        prompt_tokens = room - left
        decode = plan.trim_decode(decode, prompt_tokens, left)
        if not decode and not prompts:
            return None
        st.job_counts.mixed_job(len(decode), len(prompts), prompt_tokens)
        return self._plan(ch, JobKind.PREFILL, decode, prompts, None)

    def _decoding(self, ch: ChipState) -> bool:
        """Decode lanes run on the chip: ready for a step, or in a job in flight (ping/pong, a queued step):
        a job of prompts alone still delays their next step by its whole cost."""
        if ch.decode_ready:
            return True
        requests = self.st.requests
        for job in ch.inflight.values():
            for rid in job.lanes:
                r = requests.get(rid)
                if r is not None and r.state is RequestState.DECODE_RUNNING:
                    return True
        return False

    def _plan(self, ch: ChipState, kind: JobKind, decode: list[RequestRecord], prompts: list[PromptChunk],
              batch: int | None, steps: int = 1) -> JobPlan:
        """The plan, with drafts where lanes speculate: only in a plain one-step job (a queued step or a
        multi-step job has no room for drafts); a verification job is prefill-like, one lane per request."""
        st = self.st
        if st.spec.verify and steps == 1 and not (st.queue_next_step and any(r.job_id is not None for r in decode)):
            planned = self._drafts(ch, decode, sum(e - s for _, s, e in prompts))
            if planned is not None:
                return JobPlan(JobKind.PREFILL, decode, prompts, None, steps, planned[0],
                               planned[1] if any(planned[1]) else None)
        return JobPlan(kind, decode, prompts, batch, steps)

    # ------------------------------------------------------------- KV room
    def grow_to(self, ch: ChipState, r: RequestRecord, need: int) -> bool:
        """KV room in r's sequence for `need` tokens (whole blocks, at most max_seq); False when the pool has
        none. The one place a running sequence's reservation grows."""
        if need <= r.reserved:
            return True
        st = self.st
        target = block_end(need, ch.block_size, st.model.max_seq)
        if not ch.kv.grow(r.seq_id, target):
            return False
        st.kv_reserved += target - r.reserved
        r.reserved = target
        return True

    def _with_room(self, ch: ChipState, picked: list[RequestRecord]) -> list[RequestRecord]:
        """The picked decode lanes that have KV for their next position (growing, or preempting, for it)."""
        ready = ch.decode_ready
        chosen: list[RequestRecord] = []
        for r in picked:
            if r.job_id is not None:  # a queued next step: room for the position after its running job's
                if r.request_id in ch.queueable and self._room_for_next(ch, r):
                    chosen.append(r)
                continue
            # committed < reserved: the next position already has KV room (_ensure_room's fast case)
            if r.request_id in ready and (r.committed < r.reserved or self._ensure_room(ch, r, chosen)):
                chosen.append(r)
        return chosen

    def _ensure_room(self, ch: ChipState, r: RequestRecord, chosen: list[RequestRecord]) -> bool:
        """KV for r's next position; preempts the youngest idle sequence when the pool is dry.

        Returns False when r itself was preempted (it is requeued for recompute).
        """
        need = r.committed + 1
        while not self.grow_to(ch, r, need):
            taken = {c.request_id for c in chosen}
            idle = [self.st.requests[rid] for rid in ch.decode_ready if rid not in taken]
            victim = max(idle, key=lambda x: x.admit_order)
            self.admission.preempt(ch, victim)
            if victim is r:
                return False
        return True

    def _room_for_next(self, ch: ChipState, r: RequestRecord) -> bool:
        """KV for the position after the one r's running job writes. Never preempts: without room the lane
        waits for its job's result and goes the usual way."""
        need = r.committed + 2
        if need <= r.reserved:
            return True
        if need > self.st.model.max_seq:
            return False
        return self.grow_to(ch, r, need)

    def _steps_for(self, ch: ChipState, chosen: list[RequestRecord], now: float) -> int:
        """How many steps the next decode job runs: `decode_steps` while the batch is stable (no prompt waits,
        no deadline near, no queued step), at most the closest max_tokens, and only with KV room for all."""
        st = self.st
        cfg = st.config
        n = cfg.decode_steps
        if n <= 1 or len(ch.prefill) or st.wfq or st.requeue:
            return 1
        horizon = now + cfg.decode_steps_deadline_margin_s
        for r in chosen:
            if r.job_id is not None or r.params.constraint is not None or r.params.top_logprobs \
                    or (r.deadline is not None and r.deadline <= horizon):
                return 1
            n = min(n, r.stop.max_tokens - r.stop.produced, st.model.max_seq - r.committed)
        if n <= 1:
            return 1
        for r in chosen:
            if not self.grow_to(ch, r, r.committed + n):
                return 1
        return n

    def _drafts(self, ch: ChipState, decode: list[RequestRecord], prompt_tokens: int
                ) -> tuple[list[list[int]], list[bool]] | None:
        """Draft tokens for each decode lane, and whether the draft model fills them (None: none speculates),
        within KV room and the job's token limit."""
        st = self.st
        spec = st.spec
        if not spec.verify or not decode or len(decode) > spec.max_batch_lanes:
            return None
        limit = st.model.mixed_batch_tokens or (1 << 30)
        used = prompt_tokens + len(decode)
        plan: list[list[int]] = []
        from_model: list[bool] = []
        max_seq = st.model.max_seq
        for r in decode:
            ds, by_model = spec.drafts(r, len(decode), min(max_seq - r.committed - 1, limit - used))
            need = r.committed + 1 + len(ds)
            if need > r.reserved:  # room for the drafts: grow without preempting anyone, else draft less
                self.grow_to(ch, r, need)
                ds = ds[:max(0, draft_room(r.committed, r.reserved, max_seq))]
            used += len(ds)
            plan.append(ds)
            from_model.append(by_model and bool(ds))
        return (plan, from_model) if any(plan) else None
