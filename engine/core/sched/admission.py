"""Admission and reservation: who waits, who gets a chip's KV next, and what a refusal says.

A request joins the weighted fair queue at submit (or is refused there by
`admission_rules.decide_submit`); at each tick the head is admitted while a
chip has KV room for its prompt and the sequence budget allows, the requeue
(preempted or faulted requests) first. Lane shares (docs/architecture.md,
"Tenant lane share at admission") may preempt another tenant's youngest idle
sequence to make room. Reservation's
inverse (`unbind`) and preemption live here too: they give back what
`reserve` took.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from engine.core.actions import FailRequest
from engine.core.chip_state import ChipState
from engine.core.dispatch import ChipCandidate, choose_chip
from engine.core.kv import OutOfBlocks, PrefixKey
from engine.core.logprob_asks import whole_prompt
from engine.core.request_record import RequestRecord
from engine.core.requests import GenerateParams, RequestState
from engine.core.retry_after import NOT_READY_RETRY_S, clamp_ms, until_ms
from engine.core.sched.admission_rules import AdmissionOutcome, WaitingLoad, decide_submit
from engine.core.sched.state import SchedState

S = RequestState


class Admission:
    def __init__(self, st: SchedState) -> None:
        self.st = st

    # ------------------------------------------------------------------ submit
    def refusal(self, request_id: int, params: GenerateParams, now: float) -> FailRequest | None:
        """The 400/429/503 a request gets at submit (admission_rules.decide_submit), or None: it may queue."""
        st = self.st
        oldest_wait = 0.0
        if st.budget.max_queue_wait_s > 0:
            head = st.wfq.oldest(params.tenant)  # the lane it would join: its tenant's queue
            if head is not None:
                oldest_wait = now - st.requests[head].arrival
        decision = decide_submit(
            params, st.limits, st.budget, st.accepting, st.unavailable_reason,
            WaitingLoad(len(st.wfq) + len(st.requeue), st.waiting_tokens,
                        st.tenant_waiting_tokens[params.tenant], oldest_wait),
            st.config.tenant(params.tenant).max_waiting_tokens,
        )
        if decision.outcome is AdmissionOutcome.QUEUE:
            return None
        st.counters[f"rejected_{decision.reason}"] += 1
        st.counters["rejected"] += 1
        retry_ms = self.retry_after_ms(decision.reason, params, now) if decision.retryable else None
        return FailRequest(request_id, decision.code, decision.reason, decision.message, decision.retryable,
                           retry_after_ms=retry_ms)

    def enqueue(self, r: RequestRecord) -> None:
        """r waits for admission in its tenant's lane of the fair queue."""
        st = self.st
        p = r.params
        r.move(S.WAITING_ADMISSION)
        st.requests[r.request_id] = r
        cost = len(p.prompt) + len(p.continuation) + st.config.decode_cost_weight * (p.max_tokens - len(p.continuation))
        st.wfq.push(r.request_id, p.tenant, cost, p.priority)
        self.add_waiting(r, +1)
        if r.deadline is not None:
            heapq.heappush(st.deadlines, (r.deadline, r.request_id))
        st.dirty = True

    def retry_after_ms(self, reason: str, params: GenerateParams, now: float) -> int:
        """When a request refused at submit for `reason` (a retryable 429/503) may come back (retry_after.py)."""
        st = self.st
        b = st.budget
        waiting = len(st.wfq) + len(st.requeue)
        n = len(params.prompt) + len(params.continuation)
        rate = st.drain_rate
        if reason == "queue_full":  # room for one more: this many must be admitted first
            return clamp_ms(rate.seconds_until(now, requests=waiting + 1 - b.max_waiting_requests))
        if reason == "queue_tokens_full":
            return clamp_ms(rate.seconds_until(now, tokens=st.waiting_tokens + n - b.max_waiting_prompt_tokens))
        if reason == "tenant_quota":  # the tenant's lane drains at its share of the queue's token rate
            mine = st.tenant_waiting_tokens[params.tenant]
            cap = st.config.tenant(params.tenant).max_waiting_tokens or 0
            excess = mine + n - cap
            share = mine / st.waiting_tokens if mine and st.waiting_tokens else 1.0
            return clamp_ms(rate.seconds_until(now, tokens=math.ceil(excess / share)))
        if reason == "queue_wait_exceeded":
            return self.queue_wait_retry_ms(now)
        if reason == "draining":
            return until_ms(now, st.reopen_at)
        return clamp_ms(NOT_READY_RETRY_S)  # shutdown, or a reason this board cannot time

    def queue_wait_retry_ms(self, now: float) -> int:
        """Until the queue ahead is short enough to be admitted within admission.max_queue_wait_ms."""
        st = self.st
        waiting = len(st.wfq) + len(st.requeue)
        return clamp_ms(st.drain_rate.seconds_until(now, requests=waiting) - st.budget.max_queue_wait_s)

    def add_waiting(self, r: RequestRecord, sign: int) -> None:
        st = self.st
        n = len(r.params.prompt) + len(r.params.continuation)
        st.waiting_tokens += sign * n
        st.tenant_waiting_tokens[r.tenant] += sign * n
        assert st.waiting_tokens >= 0

    # ------------------------------------------------------------------- admit
    def admit(self, now: float) -> None:
        self.st.admission_blocked = self._admit_until_blocked(now)

    def _admit_until_blocked(self, now: float) -> str | None:
        """Admit while possible; returns why requests are still waiting (None: nobody waits)."""
        st = self.st
        if not (st.requeue or st.wfq):
            return None
        if st.config.static_batching and st.n_bound:
            return "static_batching"  # the running batch must drain completely first
        while st.n_bound < st.config.max_sequences or self._preempt_for_share():
            rid, from_requeue = self._next_candidate()
            if rid is None:
                return "tenant_cap" if st.wfq else None
            r = st.requests[rid]
            if not self._reserve(r):
                return "kv"  # head of line waits for KV (keeps fairness order; no starvation of big prompts)
            if from_requeue:
                st.requeue.popleft()
            else:
                st.wfq.pop(rid)
                self.add_waiting(r, -1)
                r.decode_key = (math.inf if r.deadline is None else r.deadline, next(st.turns))
            r.move(S.PREFILL_READY)
            r.admit_order = next(st.admit_order)
            st.drain_rate.record(now, len(r.params.prompt) + len(r.params.continuation))
            if st.imports and st.imports[-1][1] == rid:
                pass  # its tier hit is imported first (TierJobs.launch_transfers); it queues for prefill after that
            else:
                st.chips[r.chip].prefill.push(rid, r.prefill_target - r.committed)
            r.ready_since = now
            st.counters["admitted"] += 1
        return "max_sequences" if st.requeue or st.wfq else None

    def _next_candidate(self) -> tuple[int | None, bool]:
        """The request admitted next, and whether it comes from the requeue (preempted or faulted).

        The requeue goes first, except that a requeued request of a tenant at its lane share yields to
        the fair queue's pick from a tenant below it (else a lane preempted for that tenant would go
        straight back to the tenant it was taken from).
        """
        st = self.st

        def eligible(tenant: str, rid: int) -> bool:
            cap = st.config.tenant(tenant).max_active_sequences
            return cap is None or cap <= 0 or st.tenant_active[tenant] < cap

        if st.requeue:
            head = st.requests[st.requeue[0]]
            if not st.wfq or st.config.max_tenant_lane_share >= 1.0:
                return head.request_id, True
            picked = st.wfq.peek(eligible)
            if picked is None:
                return head.request_id, True
            cap, active = self._lane_caps(picked[1]), st.tenant_active
            if active[picked[1]] < cap(picked[1]) and active[head.tenant] >= cap(head.tenant):
                return picked[0], False
            return head.request_id, True
        picked = st.wfq.peek(eligible)
        return (None, False) if picked is None else (picked[0], False)

    def _lane_caps(self, waiting: str) -> Callable[[str], int]:
        """Per tenant, the sequences it may hold while `waiting` waits: the lane share of
        max_sequences, or the tenant's weighted share among those holding lanes and `waiting` where that
        is more (a tenant of weight 3 beside one of weight 1 keeps its 3 of 4)."""
        cfg, active = self.st.config, self.st.tenant_active
        present = {t for t, n in active.items() if n > 0} | {waiting}
        total = sum(cfg.tenant(t).weight for t in present)
        share, seqs = cfg.max_tenant_lane_share, cfg.max_sequences
        return lambda t: max(1, math.floor(max(share, cfg.tenant(t).weight / total) * seqs))

    def _preempt_for_share(self) -> bool:
        """Sequences full: make room for the next candidate when its tenant holds less than its lane share
        and another tenant more, by preempting that tenant's youngest idle sequence (recomputed when it
        is admitted again). False when nothing was preempted (no candidate, none below its share, no
        tenant over, or every lane of the over-share tenant is in a job: the next tick tries again)."""
        st = self.st
        if st.config.max_tenant_lane_share >= 1.0 or st.config.static_batching \
                or st.n_bound > st.config.max_sequences:  # a lowered limit (a reload) drains first
            return False
        rid, _ = self._next_candidate()
        if rid is None:
            return False
        tenant = st.requests[rid].tenant
        cap, active = self._lane_caps(tenant), st.tenant_active
        if active[tenant] >= cap(tenant):
            return False
        over = [t for t, n in active.items() if n > cap(t) and t != tenant]
        if not over:
            return False
        hog = max(over, key=lambda t: active[t] - cap(t))
        idle = [r for ch in st.chips.values() if ch.in_service for i in ch.bound
                if (r := st.requests[i]).tenant == hog and r.job_id is None
                and r.state in (S.DECODE_READY, S.PREFILL_READY)]
        if not idle:
            return False
        victim = max(idle, key=lambda x: x.admit_order)
        st.counters["preemptions_lane_share"] += 1
        self.preempt(st.chips[victim.chip], victim)
        return True

    # ----------------------------------------------------------- reservation
    def _prefix_key(self, r: RequestRecord) -> PrefixKey | None:
        if not self.st.config.prefix_cache or whole_prompt(r):
            return None
        return PrefixKey(self.st.model.generation, r.params.prefix_salt)

    def _cached_probe(self, ch: ChipState, key: PrefixKey | None, tokens: Sequence[int]) -> int:
        if key is None or len(self.st.chips) == 1 or not ch.in_service:
            return 0
        return ch.kv.cached_prefix_len(key, tokens)

    def _reserve(self, r: RequestRecord) -> bool:
        """Bind `r` to a chip with a fresh KV sequence; False when no chip has room now."""
        st = self.st
        key = self._prefix_key(r)
        n = len(r.tokens)
        reserve_len = min(n + 1, st.model.max_seq)  # the prompt and the first decode position
        limit = st.budget.max_kv_tokens
        if limit is not None and st.kv_reserved + reserve_len > limit:
            return False  # admission.max_kv_tokens: the board's reservations are full
        cands = []
        for ch in st.chips.values():
            headroom = int(st.config.kv_watermark * ch.num_blocks)
            cands.append(ChipCandidate(
                chip=ch.chip, in_service=ch.in_service,
                available_blocks=ch.kv.available_blocks() - headroom,
                blocks_needed=ch.kv.blocks_needed(reserve_len),
                cached_tokens=self._cached_probe(ch, key, r.tokens), load=ch.load,
            ))
        chip = choose_chip(cands)
        if chip is None:
            return False
        ch = st.chips[chip]
        seq_id = next(st.seq_ids)
        try:
            cached = ch.kv.reserve(seq_id, st.model.generation, r.tokens, reserve_len, key)
        except OutOfBlocks:
            return False
        assert 0 <= cached < n
        plan = None
        if st.tiers is not None and key is not None:
            plan = st.tiers.plan_import(key.salt, r.tokens, cached // ch.block_size)
            if plan is not None and st.model.lane_imports:
                st.lane_imports[r.request_id] = plan  # rides in its first prefill job (TierJobs.attach_imports)
            elif plan is not None:
                st.imports.append((chip, r.request_id, plan))
        r.chip, r.seq_id = chip, seq_id
        r.committed, r.reserved, r.prefill_target = cached, reserve_len, n
        promoted = 0 if plan is None else plan.blocks * ch.block_size
        if r.retries == 0 and r.t_first_sched is None:
            r.cached_tokens = cached + promoted
        if key is not None:
            st.counters["prefix_query_tokens"] += n
        if cached:
            st.counters["prefix_hit_tokens"] += cached
        if promoted:
            st.counters["prefix_hit_tokens"] += promoted
            st.counters["tier_hit_tokens"] += promoted
        ch.bound.add(r.request_id)
        st.n_bound += 1
        st.kv_reserved += reserve_len
        st.tenant_active[r.tenant] += 1
        return True

    def unbind(self, r: RequestRecord, released: bool) -> None:
        """Forget r's KV sequence (released to the pool, or left to the chip's fault handling)."""
        if r.seq_id is None:
            return
        st = self.st
        ch = st.chips[r.chip]
        if st.lane_imports:
            plan = st.lane_imports.pop(r.request_id, None)
            if plan is not None:  # never sent: its tier entries are free to go again
                st.tiers.drop_plan(plan)
        if released:
            ch.kv.release(r.seq_id)
        ch.bound.discard(r.request_id)
        st.n_bound -= 1
        st.kv_reserved -= r.reserved
        st.tenant_active[r.tenant] -= 1
        r.seq_id = None
        r.chip = None

    def requeue(self, r: RequestRecord) -> None:
        """r waits again, ahead of the fair queue (preempted, or its chip or job was lost)."""
        st = self.st
        r.move(S.WAITING_ADMISSION)
        st.requeue.append(r.request_id)
        st.counters["requeued"] += 1
        st.dirty = True

    def preempt(self, ch: ChipState, r: RequestRecord) -> None:
        """Take an idle sequence's KV back; r is recomputed when admitted again."""
        assert r.state in (S.DECODE_READY, S.PREFILL_READY) and r.job_id is None
        self.st.counters["preemptions"] += 1
        ch.decode_ready.pop(r.request_id, None)
        ch.prefill.remove(r.request_id)
        self.unbind(r, released=True)
        self.requeue(r)
