"""The sans-I/O scheduler: events plus `now` in, actions out.

One object owns every request, queue, KV manager and job in flight of a
board, and is driven by a single thread (seed 001 §4: the "single-thread
actor").  It never sleeps, reads a clock or touches a socket: the I/O shell
(or the simulator, or a test) calls submit/cancel/on_result/tick with the
current time and carries out the returned actions.

Lifecycle of a request: submit -> WAITING_ADMISSION (weighted fair queue) ->
PREFILL_READY once KV is reserved on a chip -> PREFILL_RUNNING (one job per
chunk) -> DECODE_READY <-> DECODE_RUNNING (continuous batching) -> COMPLETED,
or CANCELLED / FAILED from anywhere.  A request whose terminal event has been
emitted while one of its jobs is still on the chip keeps its KV until that
job drains (seed 001 §4: the job drains, the lane's result is dropped).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from engine.config_schema import ConfigError
from engine.core.actions import Action, EmitTokens, FailRequest, FinishRequest, ReleaseBlocks, SubmitJob
from engine.core.admission import (
    AdmissionOutcome,
    CapacityBudget,
    ModelLimits,
    WaitingLoad,
    decide_submit,
    queue_wait_exceeded,
)
from engine.core.retry_after import NOT_READY_RETRY_S, QueueDrainRate, clamp_ms, until_ms
from engine.core.batch_planner import BatchPlanner, PromptChunk
from engine.core.batch_profiles import resolve_profiles
from engine.core.chip_state import ChipState, InflightJob
from engine.core.constraint_spec import lane_fields
from engine.core.dispatch import ChipCandidate, choose_chip
from engine.core.fair_queue import WeightedFairQueue
from engine.core.inflight_governor import GovernorPolicy, InflightGovernor
from engine.core.kv import KvManager, OutOfBlocks, PrefixKey, StaleJob
from engine.core.prefill_queues import PrefillQueues, SmoothWeightedRoundRobin, WorkClass
from engine.core.request_record import RequestRecord
from engine.core.requests import TERMINAL_STATES, GenerateParams, RequestState
from engine.core.scheduler_config import SchedulerConfig
from engine.core.scheduler_stats import JobCounts, queue_stats, scheduler_stats
from engine.core.spec.planner import SpecPlanner, draft_room
from engine.core.stop_conditions import StopChecker, StopReason
from engine.core.text_stream import TextStream
from engine.core.tier_transfers import ImportPlan, KvTiers
from ipc.records import FOLLOW_PREVIOUS, JobKind, JobResult, JobStatus, Lane, build_job, decode_job

_TRANSFERS = (JobKind.KV_EXPORT, JobKind.KV_IMPORT)

__all__ = ["ChipSpec", "ModelSpec", "Scheduler", "SchedulerConfig"]

S = RequestState
_FOLLOW = (FOLLOW_PREVIOUS,)  # a queued next step's input token: the one the lane's running job samples
_NO_CONSTRAINT: dict = {}  # the lane fields of an unconstrained request


@dataclass(frozen=True)
class ChipSpec:
    chip: int
    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class ModelSpec:
    generation: int
    vocab_size: int
    eos_ids: tuple[int, ...]
    max_seq: int
    profiles: tuple[int, ...]  # compiled decode batches the model declares
    chunked_prefill: bool  # incremental prefill numerically equal to one-shot
    mixed_batch_tokens: int = 0  # > 0: a prefill job may mix lanes (decode + prompt chunks) up to this many tokens
    spec_verify: bool = False  # the backend verifies draft tokens (describe().extra["spec_verify"])
    spec_draft: bool = False  # the workers run a draft model (describe().extra["spec_draft"])


class Scheduler:
    def __init__(self, config: SchedulerConfig, model: ModelSpec, chips: list[ChipSpec], *,
                 piece: Callable[[int], bytes] | None = None, tiers: KvTiers | None = None) -> None:
        """`tiers`: the host/disk KV tiers below the chips (None: KV never leaves a chip).

        `piece(token_id)` is the tokenizer's bytes of a token: with it every request's output is also
        decoded to text (and may stop on strings); without it (no tokenizer) requests get token ids only."""
        if not chips:
            raise ConfigError("at least one chip is required")
        if len({c.chip for c in chips}) != len(chips):
            raise ConfigError("chip ids must be unique")
        if model.max_seq < 2 or model.vocab_size < 1:
            raise ConfigError("model max_seq must be >= 2 and vocab_size >= 1")
        for c in chips:
            if c.num_blocks < 1 or c.block_size < 1:
                raise ConfigError(f"chip {c.chip}: num_blocks and block_size must be >= 1")
        self.config = config
        self.model = model
        self.profiles = resolve_profiles(config.profiles, model.profiles)
        self.chunked = bool(config.chunked_prefill and model.chunked_prefill)
        self.planner = BatchPlanner(config, self.profiles, self.chunked, model.mixed_batch_tokens)
        # Queued next steps (issue 23): decode jobs only; a mixed job's lanes take prompts as they come.
        self._follow = bool(config.queue_next_step and not self.planner.mixed_budget)
        self._eos = tuple(model.eos_ids)
        self.spec = SpecPlanner(config.spec_method, config.spec_max_draft_tokens, config.spec_max_batch_lanes,
                                model.spec_verify, draft_model=model.spec_draft)
        self._piece = piece
        weights = {
            WorkClass.DECODE: config.decode_weight,
            WorkClass.SHORT: config.short_prefill_weight,
            WorkClass.MEDIUM: config.medium_prefill_weight,
            WorkClass.LONG: config.long_prefill_weight,
        }
        self.chips: dict[int, ChipState] = {}
        policy = GovernorPolicy(max_inflight=config.max_inflight, timeouts=config.downgrade_timeouts,
                                tpot_regression=config.downgrade_tpot_p99_ratio, window=config.downgrade_window)
        self._tpot_watch = policy.tpot_regression > 0 and policy.max_inflight > 1
        # (event, chip, reason): what the shell logs (a ping/pong downgrade); drained by take_notices()
        self.notices: list[tuple[str, int, str]] = []
        for c in chips:
            self.chips[c.chip] = ChipState(
                chip=c.chip, num_blocks=c.num_blocks, block_size=c.block_size,
                max_blocks_per_seq=math.ceil(model.max_seq / c.block_size),
                kv=KvManager(c.chip, c.num_blocks, c.block_size, model.max_seq, prefix_cache=config.prefix_cache),
                prefill=PrefillQueues(config.short_prefill_max_tokens, config.medium_prefill_max_tokens),
                wrr=SmoothWeightedRoundRobin(weights), governor=InflightGovernor(policy),
            )
        self.limits = ModelLimits(
            vocab_size=model.vocab_size, max_seq=model.max_seq,
            max_blocks_per_chip=max(c.num_blocks for c in chips), block_size=min(c.block_size for c in chips),
        )
        pool = sum(c.num_blocks * c.block_size for c in chips)
        self.budget = CapacityBudget(
            max_sequences=config.max_sequences,
            # admission.max_kv_tokens counts only below the pool: the pool itself is the chips' own limit
            max_kv_tokens=config.max_kv_tokens if 0 < config.max_kv_tokens < pool else None,
            max_waiting_requests=config.max_waiting_requests,
            max_waiting_prompt_tokens=config.max_waiting_prompt_tokens,
            max_inflight_jobs=config.max_inflight * len(chips),
            max_queue_wait_s=config.max_queue_wait_s,
        )
        self._requests: dict[int, RequestRecord] = {}
        self._wfq = WeightedFairQueue(lambda t: self.config.tenant(t).weight)
        self._requeue: deque[int] = deque()  # preempted / faulted: admitted again before the fair queue
        self._deadlines: list[tuple[float, int]] = []
        self._job_ids = itertools.count(1)
        self._seq_ids = itertools.count(1)
        self._admit_order = itertools.count(1)
        # decode turns (RequestRecord.decode_key): one at admission, then one each time a lane gets a step
        self._turns = itertools.count(1)
        self._waiting_tokens = 0
        self._tenant_waiting_tokens: Counter[str] = Counter()
        self._tenant_active: Counter[str] = Counter()
        self._n_bound = 0
        self._kv_reserved = 0  # KV tokens reserved by the bound sequences (RequestRecord.reserved)
        self._accepting = True
        self._unavailable_reason = "draining"
        self._reopen_at: float | None = None  # a drain's deadline: when a request refused by it may come back
        self.drain_rate = QueueDrainRate()  # admissions: how fast the waiting queue empties (retry_after_ms)
        self._dirty = False
        self._window_wakeup: float | None = None
        self.counters: Counter[str] = Counter()
        self.job_counts = JobCounts(self.counters, self.profiles)
        self.generation_tokens = 0  # tokens sampled (plain ints: bumped once per generated token)
        self.prompt_tokens = 0  # prompt tokens of requests that sampled their first token
        # why the waiting queue's head was not admitted at the last tick: None (nobody waits),
        # "kv" (no chip has room), "max_sequences", "tenant_cap" (every waiting tenant at its cap),
        # "static_batching"
        self.admission_blocked: str | None = None
        self.tenant_service: Counter[str] = Counter()  # tokens computed per tenant (prefill + decode)
        self.tiers = tiers
        self._imports: list[tuple[int, int, ImportPlan]] = []  # (chip, request id, plan) reserved, not launched
        if tiers is not None:
            for ch in self.chips.values():
                tiers.attach(ch.kv)

    # ------------------------------------------------------------------ events
    def submit(self, request_id: int, params: GenerateParams, now: float) -> list[Action]:
        assert request_id not in self._requests, f"request id {request_id} is already live"
        n_ctx = len(params.prompt) + len(params.continuation)
        policy = self.config.tenant(params.tenant)
        oldest_wait = 0.0
        if self.budget.max_queue_wait_s > 0:
            head = self._wfq.oldest(params.tenant)  # the lane it would join: its tenant's queue
            if head is not None:
                oldest_wait = now - self._requests[head].arrival
        decision = decide_submit(
            params, self.limits, self.budget, self._accepting, self._unavailable_reason,
            WaitingLoad(len(self._wfq) + len(self._requeue), self._waiting_tokens,
                        self._tenant_waiting_tokens[params.tenant], oldest_wait),
            policy.max_waiting_tokens,
        )
        if decision.outcome is not AdmissionOutcome.QUEUE:
            self.counters[f"rejected_{decision.reason}"] += 1
            self.counters["rejected"] += 1
            retry_ms = self._retry_after_ms(decision.reason, params, now) if decision.retryable else None
            return [FailRequest(request_id, decision.code, decision.reason, decision.message, decision.retryable,
                                retry_after_ms=retry_ms)]
        if params.stop_strings and self._piece is None:
            self.counters["rejected_no_tokenizer"] += 1
            self.counters["rejected"] += 1
            return [FailRequest(request_id, 400, "no_tokenizer", "stop: string stops need the model's tokenizer "
                                "and this model has none; use token-id stop sequences", False)]
        stop = StopChecker.build(params.max_tokens, self._eos, params.ignore_eos, params.stop_token_ids,
                                 params.stop, params.continuation)
        deadline_s = params.deadline_ms / 1000.0 if params.deadline_ms is not None else self.config.default_deadline_s
        r = RequestRecord(
            request_id=request_id, params=params, arrival=now,
            deadline=None if deadline_s is None else now + deadline_s,
            stop=stop, tokens=[int(t) for t in params.prompt] + [int(t) for t in params.continuation],
            sampling=(params.temperature, params.top_p, params.top_k, params.seed & 0xFFFFFFFFFFFFFFFF, params.logprobs),
        )
        self.counters["accepted"] += 1
        if self._piece is not None:
            r.text = TextStream(params.stop_strings)
            # The continuation was shown by another server: replay it so held text carries over.
            if r.text.prime(self._piece(int(t)) for t in params.continuation):
                return self._finish_now(r, StopReason.STOP.value, now)
        if stop.exhausted():  # the continuation already used up max_tokens: nothing to compute
            return self._finish_now(r, StopReason.LENGTH.value, now)
        r.move(S.WAITING_ADMISSION)
        self._requests[request_id] = r
        cost = n_ctx + self.config.decode_cost_weight * (params.max_tokens - len(params.continuation))
        self._wfq.push(request_id, params.tenant, cost, params.priority)
        self._add_waiting(r, +1)
        if r.deadline is not None:
            heapq.heappush(self._deadlines, (r.deadline, request_id))
        self._dirty = True
        return []

    def cancel(self, request_id: int, now: float) -> list[Action]:
        r = self._requests.get(request_id)
        if r is None or r.terminal:
            return []
        self.counters["cancelled"] += 1
        self.counters["finished_cancelled"] += 1
        out: list[Action] = [FinishRequest(request_id, "cancelled", r.usage(), r.timing(now))]
        self._terminate(r, S.CANCELLED)
        return out

    def on_result(self, chip: int, result: JobResult, now: float) -> list[Action]:
        ch = self.chips.get(chip)
        job = None if ch is None else ch.inflight.pop(result.job_id, None)
        if job is None:
            self.counters["stale_results"] += 1  # unknown, timed out or from before a fault
            return []
        assert ch is not None
        self._dirty = True
        out: list[Action] = []
        if job.kind in _TRANSFERS:
            self._transfer_result(ch, job, result, now, out)
        elif result.generation != self.model.generation or result.kind != job.kind \
                or result.tokens.shape[0] != job.batch:
            self.counters["stale_results"] += 1
            if ch.governor.on_crosstalk():  # with two jobs in flight, the answer may be the other job's
                self._downgraded(ch)
            self._fail_job(ch, job, "stale_result", "the job's result did not match its generation", now, out)
        elif result.status != JobStatus.OK:
            self.counters["failed_jobs"] += 1
            if ch.governor.on_status_anomaly():
                self._downgraded(ch)
            reason = "job_invalid" if result.status == JobStatus.INVALID else "job_failed"
            self._fail_job(ch, job, reason, f"the chip reported {result.status.name}", now, out)
        elif job.steps > 1:
            self._complete_steps(ch, job, result, now, out)
        else:
            self._complete_job(ch, job, result, now, out)
        return out

    def on_chip_down(self, chip: int, now: float) -> list[Action]:
        ch = self.chips[chip]
        out: list[Action] = []
        if not ch.in_service:
            return out
        ch.in_service = False
        ch.faults += 1
        self.counters["chip_faults"] += 1
        self._dirty = True
        # a lane in a job and in its queued next step counts once; a dropped lane is not this job's any more
        inflight_lanes = list(dict.fromkeys(rid for job in ch.inflight.values() for rid in job.lanes
                                            if rid not in job.dropped))
        if self.tiers is not None:  # its transfers are lost, and blocks noted for export are gone with the chip
            self.tiers.chip_down(chip, [j for j, job in ch.inflight.items() if job.kind in _TRANSFERS], now)
            ch.kv.tier_sink.clear()
            ch.kv.cache.evict_sink.clear()
            ch.transfers = 0
        ch.inflight.clear()
        ch.followable.clear()
        ch.kv.chip_fault()
        for rid in inflight_lanes:
            r = self._requests.get(rid)
            if r is not None:
                self._lane_lost(r, "worker_died", "the chip's worker died with this request in flight", now, out)
        # Sequences between jobs lost their KV too, but nothing was in doubt:
        # they are recomputed elsewhere from the tokens the scheduler holds.
        for rid in list(ch.bound):
            r = self._requests[rid]
            ch.prefill.remove(rid)
            ch.decode_ready.pop(rid, None)
            self._unbind(r, released=False)
            self._requeue_request(r)
        assert not ch.bound and not len(ch.prefill) and not ch.decode_ready
        return out

    def on_chip_up(self, chip: int, now: float) -> list[Action]:
        ch = self.chips[chip]
        out: list[Action] = []
        if ch.in_service:  # a restart we did not see going down
            out += self.on_chip_down(chip, now)
        ch.kv.recover_chip()
        ch.in_service = True
        self._dirty = True
        return out

    def tick(self, now: float) -> list[Action]:
        out: list[Action] = []
        self._expire_deadlines(now, out)
        self._expire_queue_waits(now, out)
        self._expire_jobs(now, out)
        self._admit(now)
        if self.tiers is not None:
            self._launch_transfers(now, out)
        self._window_wakeup = None
        for ch in self.chips.values():
            self._dispatch(ch, now, out)
        self._dirty = False
        return out

    def next_wakeup(self, now: float) -> float | None:
        if self._dirty and self.has_work():
            return now
        times: list[float] = []
        while self._deadlines:
            t, rid = self._deadlines[0]
            r = self._requests.get(rid)
            if r is None or r.terminal or r.deadline != t:
                heapq.heappop(self._deadlines)
                continue
            times.append(t)
            break
        bound = self.budget.max_queue_wait_s
        if bound > 0:
            head = self._wfq.oldest()
            if head is not None:
                times.append(self._requests[head].arrival + bound)
        for ch in self.chips.values():
            times.extend(j.timeout_at for j in ch.inflight.values())
        if self._window_wakeup is not None:
            times.append(self._window_wakeup)
        return min(times) if times else None

    def reenable_inflight(self, chip: int | None = None) -> list[int]:
        """The operator's re-enable of ping/pong after a downgrade (all chips, or one); the chips it restored."""
        done = []
        for ch in self.chips.values():
            if (chip is None or ch.chip == chip) and ch.governor.reenable():
                done.append(ch.chip)
                self.counters["inflight_reenabled"] += 1
        self._dirty = True
        return done

    def take_notices(self) -> list[tuple[str, int, str]]:
        """Events for the shell since the last call: ("inflight_downgraded", chip, reason) to log, and
        ("chip_hung", chip, "job_timeout"): the core took the chip down; the shell restarts its worker."""
        out, self.notices = self.notices, []
        return out

    def _downgraded(self, ch: ChipState) -> None:
        reason = ch.governor.downgraded
        assert reason is not None
        self.counters["inflight_downgrades"] += 1
        self.counters[f"inflight_downgrades_{reason.value}"] += 1
        self.notices.append(("inflight_downgraded", ch.chip, reason.value))

    def set_accepting(self, accepting: bool, reason: str = "draining", reopen_at: float | None = None) -> None:
        """`reopen_at`: when admission is expected back (a drain's deadline), for the refusals' retry_after_ms."""
        self._accepting = bool(accepting)
        self._unavailable_reason = reason
        self._reopen_at = None if accepting else reopen_at

    def _retry_after_ms(self, reason: str, params: GenerateParams, now: float) -> int:
        """When a request refused at submit for `reason` (a retryable 429/503) may come back (retry_after.py)."""
        b = self.budget
        waiting = len(self._wfq) + len(self._requeue)
        n = len(params.prompt) + len(params.continuation)
        rate = self.drain_rate
        if reason == "queue_full":  # room for one more: this many must be admitted first
            return clamp_ms(rate.seconds_until(now, requests=waiting + 1 - b.max_waiting_requests))
        if reason == "queue_tokens_full":
            return clamp_ms(rate.seconds_until(now, tokens=self._waiting_tokens + n - b.max_waiting_prompt_tokens))
        if reason == "tenant_quota":  # the tenant's lane drains at its share of the queue's token rate
            mine = self._tenant_waiting_tokens[params.tenant]
            cap = self.config.tenant(params.tenant).max_waiting_tokens or 0
            excess = mine + n - cap
            share = mine / self._waiting_tokens if mine and self._waiting_tokens else 1.0
            return clamp_ms(rate.seconds_until(now, tokens=math.ceil(excess / share)))
        if reason == "queue_wait_exceeded":
            return self._queue_wait_retry_ms(now)
        if reason == "draining":
            return until_ms(now, self._reopen_at)
        return clamp_ms(NOT_READY_RETRY_S)  # shutdown, or a reason this board cannot time

    def _queue_wait_retry_ms(self, now: float) -> int:
        """Until the queue ahead is short enough to be admitted within admission.max_queue_wait_ms."""
        waiting = len(self._wfq) + len(self._requeue)
        return clamp_ms(self.drain_rate.seconds_until(now, requests=waiting) - self.budget.max_queue_wait_s)

    # Settings baked into per-chip state at construction; a reload must leave them alone.
    _FIXED_SETTINGS = ("profiles", "profile_fill_ratio", "chunked_prefill", "max_inflight", "prefix_cache",
                       "decode_weight", "short_prefill_weight", "medium_prefill_weight", "long_prefill_weight",
                       "short_prefill_max_tokens", "medium_prefill_max_tokens", "static_batching", "max_kv_tokens",
                       "queue_next_step", "decode_steps", "downgrade_timeouts", "downgrade_tpot_p99_ratio", "downgrade_window")

    def reconfigure(self, config: SchedulerConfig) -> None:
        """Take new admission budgets, tenant policies, deadlines and windows (a SIGHUP reload).

        Applies to what happens next: requests already admitted keep their
        deadline and lanes; a lower `max_sequences` only stops new admissions.
        """
        for name in self._FIXED_SETTINGS:
            assert getattr(config, name) == getattr(self.config, name), f"{name} cannot change without a restart"
        self.config = config
        self.budget = dataclasses.replace(
            self.budget, max_sequences=config.max_sequences, max_waiting_requests=config.max_waiting_requests,
            max_waiting_prompt_tokens=config.max_waiting_prompt_tokens, max_queue_wait_s=config.max_queue_wait_s)
        self.planner = BatchPlanner(config, self.profiles, self.chunked, self.model.mixed_batch_tokens)
        self._dirty = True

    def shutdown(self, now: float) -> list[Action]:
        """Admission closes and every live request gets 503 "shutdown" (retryable: a balancer resumes it)."""
        self.set_accepting(False, "shutdown")
        return self.end_live(now, "the server is shutting down")

    def end_live(self, now: float, message: str) -> list[Action]:
        """Every live request gets 503 "shutdown" (retryable), e.g. when an admin drain's time is up.

        Jobs still on a chip keep their KV until their results drain (or the
        chip is declared down); everything else is released at once.
        """
        out: list[Action] = []
        for r in list(self._requests.values()):
            if r.terminal:
                continue
            self.counters["failed_shutdown"] += 1
            out.append(FailRequest(r.request_id, 503, "shutdown", message, True, r.timing(now),
                                   retry_after_ms=clamp_ms(NOT_READY_RETRY_S)))
            self._terminate(r, S.FAILED)
        return out

    def has_work(self) -> bool:
        return bool(self._requests) or any(ch.inflight for ch in self.chips.values())

    # --------------------------------------------------------------- admission
    def _add_waiting(self, r: RequestRecord, sign: int) -> None:
        n = len(r.params.prompt) + len(r.params.continuation)
        self._waiting_tokens += sign * n
        self._tenant_waiting_tokens[r.tenant] += sign * n
        assert self._waiting_tokens >= 0

    def _admit(self, now: float) -> None:
        self.admission_blocked = self._admit_until_blocked(now)

    def _admit_until_blocked(self, now: float) -> str | None:
        """Admit while possible; returns why requests are still waiting (None: nobody waits)."""
        if not (self._requeue or self._wfq):
            return None
        if self.config.static_batching and self._n_bound:
            return "static_batching"  # the running batch must drain completely first
        while self._n_bound < self.config.max_sequences or self._preempt_for_share():
            rid, from_requeue = self._next_candidate()
            if rid is None:
                return "tenant_cap" if self._wfq else None
            r = self._requests[rid]
            if not self._reserve(r):
                return "kv"  # head of line waits for KV (keeps fairness order; no starvation of big prompts)
            if from_requeue:
                self._requeue.popleft()
            else:
                self._wfq.pop(rid)
                self._add_waiting(r, -1)
                r.decode_key = (math.inf if r.deadline is None else r.deadline, next(self._turns))
            r.move(S.PREFILL_READY)
            r.admit_order = next(self._admit_order)
            self.drain_rate.record(now, len(r.params.prompt) + len(r.params.continuation))
            if self._imports and self._imports[-1][1] == rid:
                pass  # its tier hit is imported first (_launch_transfers); it queues for prefill after that
            else:
                self.chips[r.chip].prefill.push(rid, r.prefill_target - r.committed)
            r.ready_since = now
            self.counters["admitted"] += 1
        return "max_sequences" if self._requeue or self._wfq else None

    def _next_candidate(self) -> tuple[int | None, bool]:
        """The request admitted next, and whether it comes from the requeue (preempted or faulted).

        The requeue goes first, except that a requeued request of a tenant at its lane share yields to
        the fair queue's pick from a tenant below it (else a lane preempted for that tenant would go
        straight back to the tenant it was taken from).
        """

        def eligible(tenant: str, rid: int) -> bool:
            cap = self.config.tenant(tenant).max_active_sequences
            return cap is None or cap <= 0 or self._tenant_active[tenant] < cap

        if self._requeue:
            head = self._requests[self._requeue[0]]
            if not self._wfq or self.config.max_tenant_lane_share >= 1.0:
                return head.request_id, True
            picked = self._wfq.peek(eligible)
            if picked is None:
                return head.request_id, True
            cap, active = self._lane_caps(picked[1]), self._tenant_active
            if active[picked[1]] < cap(picked[1]) and active[head.tenant] >= cap(head.tenant):
                return picked[0], False
            return head.request_id, True
        picked = self._wfq.peek(eligible)
        return (None, False) if picked is None else (picked[0], False)

    def _lane_caps(self, waiting: str) -> Callable[[str], int]:
        """Per tenant, the sequences it may hold while `waiting` waits (seed 001 §7.2): the lane share of
        max_sequences, or the tenant's weighted share among those holding lanes and `waiting` where that
        is more (a tenant of weight 3 beside one of weight 1 keeps its 3 of 4)."""
        cfg, active = self.config, self._tenant_active
        present = {t for t, n in active.items() if n > 0} | {waiting}
        total = sum(cfg.tenant(t).weight for t in present)
        share, seqs = cfg.max_tenant_lane_share, cfg.max_sequences
        return lambda t: max(1, math.floor(max(share, cfg.tenant(t).weight / total) * seqs))

    def _preempt_for_share(self) -> bool:
        """Sequences full: make room for the next candidate when its tenant holds less than its lane share
        and another tenant more, by preempting that tenant's youngest idle sequence (recomputed when it
        is admitted again). False when nothing was preempted (no candidate, none below its share, no
        tenant over, or every lane of the over-share tenant is in a job: the next tick tries again)."""
        if self.config.max_tenant_lane_share >= 1.0 or self.config.static_batching \
                or self._n_bound > self.config.max_sequences:  # a lowered limit (a reload) drains first
            return False
        rid, _ = self._next_candidate()
        if rid is None:
            return False
        tenant = self._requests[rid].tenant
        cap, active = self._lane_caps(tenant), self._tenant_active
        if active[tenant] >= cap(tenant):
            return False
        over = [t for t, n in active.items() if n > cap(t) and t != tenant]
        if not over:
            return False
        hog = max(over, key=lambda t: active[t] - cap(t))
        idle = [r for ch in self.chips.values() if ch.in_service for i in ch.bound
                if (r := self._requests[i]).tenant == hog and r.job_id is None
                and r.state in (S.DECODE_READY, S.PREFILL_READY)]
        if not idle:
            return False
        victim = max(idle, key=lambda x: x.admit_order)
        self.counters["preemptions_lane_share"] += 1
        self._preempt(self.chips[victim.chip], victim)
        return True

    def _prefix_key(self, r: RequestRecord) -> PrefixKey | None:
        if not self.config.prefix_cache:
            return None
        return PrefixKey(self.model.generation, r.params.prefix_salt)

    def _cached_probe(self, ch: ChipState, key: PrefixKey | None, tokens: Sequence[int]) -> int:
        if key is None or len(self.chips) == 1 or not ch.in_service:
            return 0
        return ch.kv.cached_prefix_len(key, tokens)

    def _reserve(self, r: RequestRecord) -> bool:
        """Bind `r` to a chip with a fresh KV sequence; False when no chip has room now."""
        key = self._prefix_key(r)
        n = len(r.tokens)
        reserve_len = min(n + 1, self.model.max_seq)  # the prompt and the first decode position
        limit = self.budget.max_kv_tokens
        if limit is not None and self._kv_reserved + reserve_len > limit:
            return False  # admission.max_kv_tokens: the board's reservations are full
        cands = []
        for ch in self.chips.values():
            headroom = int(self.config.kv_watermark * ch.num_blocks)
            cands.append(ChipCandidate(
                chip=ch.chip, in_service=ch.in_service,
                available_blocks=ch.kv.available_blocks() - headroom,
                blocks_needed=ch.kv.blocks_needed(reserve_len),
                cached_tokens=self._cached_probe(ch, key, r.tokens), load=ch.load,
            ))
        chip = choose_chip(cands)
        if chip is None:
            return False
        ch = self.chips[chip]
        seq_id = next(self._seq_ids)
        try:
            cached = ch.kv.reserve(seq_id, self.model.generation, r.tokens, reserve_len, key)
        except OutOfBlocks:
            return False
        assert 0 <= cached < n
        plan = None
        if self.tiers is not None and key is not None:
            plan = self.tiers.plan_import(key.salt, r.tokens, cached // ch.block_size)
            if plan is not None:
                self._imports.append((chip, r.request_id, plan))
        r.chip, r.seq_id = chip, seq_id
        r.committed, r.reserved, r.prefill_target = cached, reserve_len, n
        promoted = 0 if plan is None else plan.blocks * ch.block_size
        if r.retries == 0 and r.t_first_sched is None:
            r.cached_tokens = cached + promoted
        if key is not None:
            self.counters["prefix_query_tokens"] += n
        if cached:
            self.counters["prefix_hit_tokens"] += cached
        if promoted:
            self.counters["prefix_hit_tokens"] += promoted
            self.counters["tier_hit_tokens"] += promoted
        ch.bound.add(r.request_id)
        self._n_bound += 1
        self._kv_reserved += reserve_len
        self._tenant_active[r.tenant] += 1
        return True

    def _unbind(self, r: RequestRecord, released: bool) -> None:
        """Forget r's KV sequence (released to the pool, or left to the chip's fault handling)."""
        if r.seq_id is None:
            return
        ch = self.chips[r.chip]
        if released:
            ch.kv.release(r.seq_id)
        ch.bound.discard(r.request_id)
        self._n_bound -= 1
        self._kv_reserved -= r.reserved
        self._tenant_active[r.tenant] -= 1
        r.seq_id = None
        r.chip = None

    def _requeue_request(self, r: RequestRecord) -> None:
        r.move(S.WAITING_ADMISSION)
        self._requeue.append(r.request_id)
        self.counters["requeued"] += 1
        self._dirty = True

    def _retry_or_fail(self, r: RequestRecord, reason: str, message: str, now: float, out: list[Action]) -> None:
        """A request whose job was lost: requeue while nothing reached the client, else 500 (retryable elsewhere)."""
        if r.emitted == 0 and r.retries < self.config.max_retries:
            r.retries += 1
            self._requeue_request(r)
            return
        self.counters[f"failed_{reason}"] += 1
        out.append(FailRequest(r.request_id, 500, reason, message, True, r.timing(now)))
        self._terminate(r, S.FAILED)

    # ------------------------------------------------------------- terminals
    def _finish_now(self, r: RequestRecord, reason: str, now: float) -> list[Action]:
        self.counters[f"finished_{reason}"] += 1
        r.terminal_emitted = True
        return [FinishRequest(r.request_id, reason, r.usage(), r.timing(now))]

    def _terminate(self, r: RequestRecord, state: RequestState) -> None:
        """Enter a terminal state (the caller emitted the terminal event) and reclaim what is not in flight."""
        assert not r.terminal_emitted, f"request {r.request_id}: second terminal event"
        r.terminal_emitted = True
        old = r.state
        if old is S.WAITING_ADMISSION:
            if self._wfq.remove(r.request_id):
                self._add_waiting(r, -1)
            else:
                self._requeue.remove(r.request_id)
        elif old in (S.PREFILL_READY, S.DECODE_READY):
            ch = self.chips[r.chip]
            ch.prefill.remove(r.request_id)
            ch.decode_ready.pop(r.request_id, None)
            self._unbind(r, released=True)
        elif old is S.DECODE_RUNNING and self._follow and r.chip is not None:
            self.chips[r.chip].followable.pop(r.request_id, None)  # no next step for it now
        if state is S.COMPLETED:
            r.move(S.FINISHING)
        r.move(state)
        self._forget_if_done(r)

    def _forget_if_done(self, r: RequestRecord) -> None:
        if r.terminal and r.job_id is None and r.seq_id is None:
            self._requests.pop(r.request_id, None)

    def _expire_deadlines(self, now: float, out: list[Action]) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            t, rid = heapq.heappop(self._deadlines)
            r = self._requests.get(rid)
            if r is None or r.terminal or r.deadline != t:
                continue
            self.counters["failed_deadline_exceeded"] += 1
            out.append(FailRequest(rid, 504, "deadline_exceeded", "the request's deadline passed", False, r.timing(now)))
            self._terminate(r, S.FAILED)

    def _expire_queue_waits(self, now: float, out: list[Action]) -> None:
        """admission.max_queue_wait_ms: a request still in the fair queue that long gets 429 queue_wait_exceeded
        (retryable: another board may serve it in time). Waits run out in arrival order, so only the oldest
        is looked at; a request requeued after a preemption or a fault was admitted once and is not bound."""
        bound = self.budget.max_queue_wait_s
        if bound <= 0:
            return
        wfq, requests = self._wfq, self._requests
        d = None
        retry_ms = 0
        while (rid := wfq.oldest()) is not None:
            r = requests[rid]
            if r.arrival + bound > now:  # the same sum as next_wakeup's, so the wake-up at it expires it
                return
            if d is None:
                d = queue_wait_exceeded(bound, head=False)
                retry_ms = self._queue_wait_retry_ms(now)
            self.counters[f"failed_{d.reason}"] += 1
            out.append(FailRequest(rid, d.code, d.reason, d.message, d.retryable, r.timing(now),
                                   retry_after_ms=retry_ms))
            self._terminate(r, S.FAILED)

    def _expire_jobs(self, now: float, out: list[Action]) -> None:
        """A job past job_timeout means a hung chip: its lanes fail (KV Unknown, quarantined), then the whole
        chip goes down as on a worker death and a "chip_hung" notice asks the shell to restart the worker;
        its READY (on_chip_up) recovers the KV, so nothing waits on the quarantine forever."""
        for ch in self.chips.values():
            late = [j for j in ch.inflight.values() if j.timeout_at <= now]
            if not late:
                continue
            for job in late:
                del ch.inflight[job.job_id]
                if job.kind in _TRANSFERS:
                    ch.transfers -= 1
                    self.tiers.job_done(job.job_id, False, False, now)
                self.counters["timed_out_jobs"] += 1
                if ch.governor.on_timeout():
                    self._downgraded(ch)
                self._fail_job(ch, job, "job_timeout", "the chip did not answer within job_timeout", now, out)
            if ch.in_service:
                out += self.on_chip_down(ch.chip, now)
                self.counters["hung_chips"] += 1
                self.notices.append(("chip_hung", ch.chip, "job_timeout"))

    # ------------------------------------------------------------ completions
    def _fail_job(self, ch: ChipState, job: InflightJob, reason: str, message: str, now: float,
                  out: list[Action]) -> None:
        """Every lane of a failed job: KV Unknown (quarantined until the chip recovers), request retried or 500."""
        self._dirty = True
        dropped = job.dropped
        for rid, seq_id in zip(job.lanes, job.seq_ids):
            if rid in dropped:
                continue  # lost with the job before it, already handled
            r = self._requests.get(rid)
            try:
                ch.kv.fail(seq_id, job.job_id)
            except StaleJob:
                pass
            ch.kv.release(seq_id)  # drops the UNKNOWN entry; its blocks stay quarantined until recovery
            if r is not None:
                self._lane_lost(r, reason, message, now, out)

    def _lane_lost(self, r: RequestRecord, reason: str, message: str, now: float, out: list[Action]) -> None:
        """A lane of a job that will never complete (job failed, chip down): unbind; retry or fail unless ended."""
        if r.next_job is not None or self._follow:
            self._drop_from_other_job(r)
        r.job_id = None
        r.next_job = None
        self._unbind(r, released=False)
        if r.terminal:
            self._forget_if_done(r)
        else:
            self._retry_or_fail(r, reason, message, now, out)

    def _drop_from_other_job(self, r: RequestRecord) -> None:
        """r's lane is lost: the other job that carries it (its queued next step, or the step that one follows)
        no longer answers for it; its KV went with this failure."""
        ch = self.chips[r.chip] if r.chip is not None else None
        if ch is None:
            return
        ch.followable.pop(r.request_id, None)
        for j in (r.job_id, r.next_job):
            other = ch.inflight.get(j) if j is not None else None
            if other is not None:
                other.dropped.add(r.request_id)

    def _complete_job(self, ch: ChipState, job: InflightJob, result: JobResult, now: float,
                      out: list[Action]) -> None:
        # Runs once per job; its loop once per lane, i.e. per generated token: keep the loop body lean.
        requests, kv, service = self._requests, ch.kv, self.tenant_service
        job_id = job.job_id
        any_sampled = any(job.sampled)
        toks = result.tokens.tolist() if any_sampled else None  # Python ints once, not a numpy scalar per lane
        lps = result.logprobs
        lps = [] if lps is None or not any_sampled else lps.tolist()
        n_lps = len(lps)
        vocab = self.model.vocab_size
        start_lens = job.start_lens
        dropped, followable = job.dropped, ch.followable if self._follow else None
        for lane, (rid, seq_id, new_len, sampled) in enumerate(zip(job.lanes, job.seq_ids, job.new_lens,
                                                                   job.sampled)):
            if dropped and rid in dropped:
                continue  # its step before failed: the lane was handled then
            r = requests[rid]
            assert r.job_id == job_id and r.seq_id == seq_id
            if job.drafts is not None and job.drafts[lane]:
                self._complete_verify(ch, job, lane, r, result, toks, lps, now, out)
                continue
            nxt = r.next_job  # a queued next step takes the lane over (KV: the hand-off at commit)
            r.job_id, r.next_job = nxt, None
            if followable is not None and nxt is None:
                followable.pop(rid, None)
            if r.state in TERMINAL_STATES:  # cancelled / expired / shut down while running: drop the output
                if len(r.tokens) >= new_len:
                    kv.commit(seq_id, job_id, r.tokens)
                    r.committed = new_len
                else:  # a queued step whose input token was never accepted: nothing of it is kept
                    kv.abandon(seq_id, job_id)
                    self.counters["queued_steps_discarded"] += 1
                if nxt is None:  # else its queued step drains first: it still writes this lane's blocks
                    self._unbind(r, released=True)
                    self._forget_if_done(r)
                continue
            kv.commit(seq_id, job_id, r.tokens)  # holds >= new_len tokens; the KV manager reads only those
            r.committed = new_len
            service[r.params.tenant] += new_len - start_lens[lane]
            if not sampled:
                r.move(S.PREFILL_READY)
                ch.prefill.push(rid, r.prefill_target, front=True)
                r.ready_since = now
                continue
            token = toks[lane]
            if not 0 <= token < vocab:
                self.counters["failed_bad_token"] += 1
                out.append(FailRequest(rid, 500, "bad_token", f"the chip returned token {token}", False,
                                       r.timing(now)))
                self._terminate_running(r, ch, S.FAILED)
                continue
            self._accept_token(r, ch, token, lps[lane] if n_lps > lane else 0.0, now, out)

    def _complete_verify(self, ch: ChipState, job: InflightJob, lane: int, r: RequestRecord, result: JobResult,
                         toks: list[int] | None, lps: list[float], now: float, out: list[Action]) -> None:
        """A lane that carried drafts: commit the accepted run, give back the rest, emit token by token."""
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
                self._unbind(r, released=True)
                self._forget_if_done(r)
                return
            self.counters["failed_bad_token"] += 1
            out.append(FailRequest(r.request_id, 500, "bad_token", f"the chip accepted {a} of {n_drafted} drafts",
                                   False, r.timing(now)))
            self._terminate_running(r, ch, S.FAILED)
            return
        new_len = start + 1 + a
        ch.kv.commit(r.seq_id, job.job_id, r.tokens + drafts[:a], upto=new_len)
        r.committed = new_len
        self.tenant_service[r.params.tenant] += new_len - start
        if r.state in TERMINAL_STATES:
            self._unbind(r, released=True)
            self._forget_if_done(r)
            return
        # rejected drafts' KV: keep only the room a plain decode step would hold (the next position's block)
        keep = min(self.model.max_seq, -(-(new_len + 1) // ch.block_size) * ch.block_size)
        if keep < r.reserved:
            ch.kv.rollback_tail(r.seq_id, keep)
            self._kv_reserved -= r.reserved - keep
            r.reserved = keep
        self.spec.observe(r, n_drafted, a)
        run = drafts[:a] + [toks[lane]]
        acc_lps = result.accepted_logprobs
        if r.params.logprobs and acc_lps is not None:
            run_lps = acc_lps[at:at + a].tolist() + [lps[lane] if len(lps) > lane else 0.0]
        else:
            run_lps = [0.0] * len(run)
        vocab = self.model.vocab_size
        for i, token in enumerate(run):
            if not 0 <= token < vocab:
                self.counters["failed_bad_token"] += 1
                out.append(FailRequest(r.request_id, 500, "bad_token", f"the chip returned token {token}", False,
                                       r.timing(now)))
                self._terminate_running(r, ch, S.FAILED)
                return
            if self._accept_token(r, ch, token, run_lps[i], now, out, more=i + 1 < len(run)):
                return  # a stop inside the run: nothing after it is streamed

    def _terminate_running(self, r: RequestRecord, ch: ChipState, state: RequestState) -> None:
        """Terminal state for a request whose job just completed (its KV is committed; a queued next step
        still in flight keeps it bound until it drains, and its output is dropped)."""
        if r.job_id is None:
            self._unbind(r, released=True)
        else:
            self.counters["queued_steps_past_end"] += 1
        self._terminate(r, state)

    def _complete_steps(self, ch: ChipState, job: InflightJob, result: JobResult, now: float,
                        out: list[Action]) -> None:
        """A multi-step decode job: each lane's row of tokens, kept up to the lane's end (the rest dropped)."""
        requests, kv, job_id, vocab = self._requests, ch.kv, job.job_id, self.model.vocab_size
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
                self._unbind(r, released=True)
                self._forget_if_done(r)
                continue
            row = rows[lane]
            # the KV of steps 2..n was computed from this row's first n-1 tokens: valid for them
            kv.commit(seq_id, job_id, r.tokens + row[:n - 1])
            r.committed = new_len
            self.tenant_service[r.params.tenant] += new_len - start
            for k, token in enumerate(row):
                if not 0 <= token < vocab:
                    self.counters["failed_bad_token"] += 1
                    out.append(FailRequest(rid, 500, "bad_token", f"the chip returned token {token}", False,
                                           r.timing(now)))
                    self._terminate_running(r, ch, S.FAILED)
                    break
                self._accept_token(r, ch, token, lps[lane][k] if lps else 0.0, now, out, more=k < n - 1)
                if r.terminal_emitted:
                    self.counters["multi_step_tokens_dropped"] += n - 1 - k  # sampled past the lane's end
                    break

    def _steps_for(self, ch: ChipState, chosen: list[RequestRecord], now: float) -> int:
        """How many steps the next decode job runs: `decode_steps` while the batch is stable (no prompt waits,
        no deadline near, no queued step), at most the closest max_tokens, and only with KV room for all."""
        cfg = self.config
        n = cfg.decode_steps
        if n <= 1 or len(ch.prefill) or self._wfq or self._requeue:
            return 1
        horizon = now + cfg.decode_steps_deadline_margin_s
        for r in chosen:
            if r.job_id is not None or r.params.constraint is not None \
                    or (r.deadline is not None and r.deadline <= horizon):
                return 1
            n = min(n, r.stop.max_tokens - r.stop.produced, self.model.max_seq - r.committed)
        if n <= 1:
            return 1
        bs = ch.block_size
        for r in chosen:
            need = r.committed + n
            if need > r.reserved:
                target = min(self.model.max_seq, -(-need // bs) * bs)
                if not ch.kv.grow(r.seq_id, target):
                    return 1
                self._kv_reserved += target - r.reserved
                r.reserved = target
        return n

    def _accept_token(self, r: RequestRecord, ch: ChipState, token: int, logprob: float, now: float,
                      out: list[Action], more: bool = False) -> bool:
        """Feed one sampled token; True when the request stopped. `more`: further tokens of this lane follow
        (a multi-step job's, or an accepted draft run), so the request stays running until the last one."""
        r.tokens.append(token)
        r.generated += 1
        self.generation_tokens += 1
        if r.generated == 1:  # the prompt counts once, when its first token is sampled (as vLLM counts it)
            self.prompt_tokens += len(r.params.prompt)
        emit, emit_lps, stop = r.stop.feed(token, logprob)
        text = None
        ts = r.text
        if ts is not None:
            if ts.plain and stop is None and len(emit) == 1:  # the common case, without a TextStep
                text = ts.decode(self._piece(emit[0]))
            else:
                emit, text, stop = self._detokenize(ts, emit, stop)
        if emit or text:
            if r.t_first_token is None:
                r.t_first_token = now
            elif self._tpot_watch and ch.governor.on_interval(now - r.t_last_token):
                self._downgraded(ch)
            r.t_last_token = now
            r.emitted += len(emit)
            out.append(EmitTokens(r.request_id, emit, emit_lps[:len(emit)] if r.params.logprobs else None, text))
        if stop is not None:
            if r.t_first_token is None:
                r.t_first_token = r.t_last_token = now
            reason = stop.value
            self.counters[f"finished_{reason}"] += 1
            if r.job_id is None:
                self._unbind(r, released=True)
            else:  # its queued next step is past the end: it drains, then the lane is released
                self.counters["queued_steps_past_end"] += 1
            r.move(S.FINISHING)
            out.append(FinishRequest(r.request_id, reason, r.usage(), r.timing(now)))
            r.terminal_emitted = True
            r.move(S.COMPLETED)
            self._forget_if_done(r)
            return True
        if more:
            return False
        if r.job_id is not None:  # its queued next step already carries it (still DECODE_RUNNING)
            self._may_follow(ch, r)
            return False
        r.move(S.DECODE_READY)
        r.ready_since = now
        ch.decode_ready[r.request_id] = None
        return False

    def _detokenize(self, ts: TextStream, emit: list[int], stop: StopReason | None
                    ) -> tuple[list[int], str, StopReason | None]:
        """Feed the released tokens' bytes to the text stream: (tokens to emit, text delta, stop reason).

        A stop string ends the request at the token that completes it; that
        token and the ones before it are emitted (ids are the raw output), the
        text ends before the stop string. When generation ends for another
        reason the held text is flushed.
        """
        piece = self._piece
        parts: list[str] = []
        for i, tok in enumerate(emit):
            step = ts.feed(piece(tok))
            if step.text:
                parts.append(step.text)
            if step.stopped:
                return emit[:i + 1], "".join(parts), StopReason.STOP
        if stop is not None:
            step = ts.finish()
            if step.text:
                parts.append(step.text)
            if step.stopped:
                stop = StopReason.STOP
        return emit, "".join(parts), stop

    # -------------------------------------------------------------- dispatch
    def _dispatch(self, ch: ChipState, now: float, out: list[Action]) -> None:
        """Fill the chip's free job slots, choosing decode vs prefill classes by weighted round robin."""
        budget = self.planner.mixed_budget
        if budget:
            while ch.in_service and len(ch.inflight) - ch.transfers < ch.governor.limit() \
                    and self._submit_mixed(ch, budget, now, out):
                pass
            return
        limit = ch.governor.limit()
        decode_failed = False  # no decode job could go this time (no KV room): the slot goes to prompts
        while ch.in_service:
            n = len(ch.inflight) - ch.transfers
            # With queued next steps the chip takes one job past the limit while a running lane may be
            # followed: its next step, or a prompt's job in its place (the chip then runs that instead).
            if n >= limit and not (n == limit and self._follow and ch.followable):
                return
            classes = ch.prefill.nonempty()
            if not decode_failed and ((self._follow and ch.followable) or (
                    ch.decode_ready and self._may_fire(self.planner.decode_hold(ch.decode_ready, self._requests, now)))):
                classes.append(WorkClass.DECODE)
            cls = ch.wrr.pick(classes)
            if cls is None:
                return
            if cls is WorkClass.DECODE:
                decode_failed = not self._submit_decode(ch, now, out)
            else:
                self._submit_prefill(ch, ch.prefill.pop(cls), now, out)

    def _may_fire(self, hold_until: float | None) -> bool:
        """A window's verdict (None: go now); a held job notes when to look again."""
        if hold_until is None:
            return True
        wake = self._window_wakeup
        self._window_wakeup = hold_until if wake is None else min(wake, hold_until)
        return False

    def _ensure_room(self, ch: ChipState, r: RequestRecord, chosen: list[RequestRecord]) -> bool:
        """KV for r's next position; preempts the youngest idle sequence when the pool is dry.

        Returns False when r itself was preempted (it is requeued for recompute).
        """
        need = r.committed + 1
        while need > r.reserved:
            bs = ch.block_size
            target = min(self.model.max_seq, -(-need // bs) * bs)
            if ch.kv.grow(r.seq_id, target):
                self._kv_reserved += target - r.reserved
                r.reserved = target
                return True
            taken = {c.request_id for c in chosen}
            idle = [self._requests[rid] for rid in ch.decode_ready if rid not in taken]
            victim = max(idle, key=lambda x: x.admit_order)
            self._preempt(ch, victim)
            if victim is r:
                return False
        return True

    def _preempt(self, ch: ChipState, r: RequestRecord) -> None:
        assert r.state in (S.DECODE_READY, S.PREFILL_READY) and r.job_id is None
        self.counters["preemptions"] += 1
        ch.decode_ready.pop(r.request_id, None)
        ch.prefill.remove(r.request_id)
        self._unbind(r, released=True)
        self._requeue_request(r)

    def _with_room(self, ch: ChipState, picked: list[RequestRecord]) -> list[RequestRecord]:
        """The picked decode lanes that have KV for their next position (growing, or preempting, for it)."""
        ready = ch.decode_ready
        chosen: list[RequestRecord] = []
        for r in picked:
            if r.job_id is not None:  # a queued next step: room for the position after its running job's
                if r.request_id in ch.followable and self._room_for_next(ch, r):
                    chosen.append(r)
                continue
            # committed < reserved: the next position already has KV room (_ensure_room's fast case)
            if r.request_id in ready and (r.committed < r.reserved or self._ensure_room(ch, r, chosen)):
                chosen.append(r)
        return chosen

    @staticmethod
    def _may_follow(ch: ChipState, r: RequestRecord) -> None:
        """r's job is running: its next step may be queued unless that job's token is its last (max_tokens),
        or its output is constrained (the worker's matcher takes its tokens in order, job by job)."""
        if r.stop.max_tokens - r.stop.produced > 1 and r.params.constraint is None:
            ch.followable[r.request_id] = None

    def _room_for_next(self, ch: ChipState, r: RequestRecord) -> bool:
        """KV for the position after the one r's running job writes. Never preempts: without room the lane
        waits for its job's result and goes the usual way."""
        need = r.committed + 2
        if need <= r.reserved:
            return True
        if need > self.model.max_seq:
            return False
        target = min(self.model.max_seq, -(-need // ch.block_size) * ch.block_size)
        if not ch.kv.grow(r.seq_id, target):
            return False
        self._kv_reserved += target - r.reserved
        r.reserved = target
        return True

    def _submit_decode(self, ch: ChipState, now: float, out: list[Action]) -> bool:
        """One decode job; False when none could go. With queued next steps, the lanes running now that may
        be followed are candidates beside the ready ones."""
        plan = self.planner
        pool: Collection[int] = ch.decode_ready
        if self._follow and ch.followable:
            pool = {**ch.decode_ready, **ch.followable}
        cands = plan.decode_candidates(pool, self._requests)
        chosen = self._with_room(ch, plan.pick_lanes(cands, plan.decode_profile(len(cands))))
        if not chosen:
            return False
        batch = plan.fitting_profile(len(chosen))
        self.job_counts.decode_job(batch, len(chosen))
        steps = self._steps_for(ch, chosen, now) if self.config.decode_steps > 1 else 1
        self._launch(ch, JobKind.DECODE, chosen, [], batch, now, out, steps)
        return True

    def _submit_prefill(self, ch: ChipState, rid: int, now: float, out: list[Action]) -> None:
        r = self._requests[rid]
        start = r.committed
        end = self.planner.prefill_end(start, r.prefill_target)
        self.job_counts.prefill_job(end - start)
        self._launch(ch, JobKind.PREFILL, [], [(r, start, end)], None, now, out)

    def _submit_mixed(self, ch: ChipState, budget: int, now: float, out: list[Action]) -> bool:
        """One job of the ready decode lanes plus prompt chunks, `budget` tokens in all; False when idle.

        Mixed batches (vLLM's token budget, llama.cpp's server loop): decode
        lanes ride along with every job, so a prompt burst no longer stalls
        the streams already generating, and several prompts share one pass
        over the weights. Which lanes and chunks: `BatchPlanner.take_prompts`.
        With `decode_steps` > 1 and no prompt waiting, the lanes go as a
        multi-step decode job instead (`_submit_steps`).
        """
        plan, requests = self.planner, self._requests
        decode: list[RequestRecord] = []
        waiting = len(ch.prefill)
        if waiting and not ch.decode_ready:
            if not self._may_fire(plan.prompts_hold(ch.prefill, requests, budget, now)):
                return False
        if ch.decode_ready and (waiting or self._may_fire(plan.decode_hold(ch.decode_ready, requests, now))):
            cands = plan.decode_candidates(ch.decode_ready, requests)
            decode = self._with_room(ch, plan.mixed_decode_lanes(cands, budget, bool(waiting)))
            if decode and not waiting and self.config.decode_steps > 1 and self._submit_steps(ch, decode, now, out):
                return True
        prompts, left = plan.take_prompts(ch.prefill, ch.wrr, requests, budget - len(decode))
        prompt_tokens = budget - len(decode) - left
        decode = plan.trim_decode(decode, prompt_tokens, left)
        if not decode and not prompts:
            return False
        self.job_counts.mixed_job(len(decode), len(prompts), prompt_tokens)
        self._launch(ch, JobKind.PREFILL, decode, prompts, None, now, out)
        return True

    def _submit_steps(self, ch: ChipState, decode: list[RequestRecord], now: float, out: list[Action]) -> bool:
        """The decode lanes of a mixed job with no prompt beside them as one multi-step decode job, in the
        compiled profile that fits them, while the batch is stable (`_steps_for`); False: no multi-step job
        (the lanes go in a one-step mixed job, and the next prompt to arrive rides in one again)."""
        steps = self._steps_for(ch, decode, now)
        if steps <= 1:
            return False
        batch = self.planner.fitting_profile(len(decode))
        self.job_counts.decode_job(batch, len(decode))
        self._launch(ch, JobKind.DECODE, decode, [], batch, now, out, steps)
        return True

    def _lane(self, r: RequestRecord, ch: ChipState, start: int, end: int, sample: bool,
              drafts: list[int] | None = None, draft_model: bool = False) -> Lane:
        """The one place a request becomes a job lane (per-lane inputs the chip needs go here)."""
        p = r.params
        if p.constraint is None and not drafts:  # the common lane, positionally (one per generated token)
            return Lane(r.tokens[start:end], start, ch.kv.block_table_view(r.seq_id), sample, p.temperature,
                        p.top_p, p.top_k, p.seed, p.logprobs)
        # block_table_view: not copied, build_job copies it into the record before the KV changes again
        return Lane(
            tokens=r.tokens[start:end] if not drafts else r.tokens[start:start + 1] + drafts, start=start,
            block_table=ch.kv.block_table_view(r.seq_id), sample=sample,
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed, want_logprobs=p.logprobs,
            drafts=len(drafts) if drafts else 0, draft_model=draft_model,
            **(_NO_CONSTRAINT if p.constraint is None else
               lane_fields(p.constraint, r.request_id, r.tokens, len(p.prompt), end, r.prefill_target)),
        )

    def _plan_drafts(self, ch: ChipState, decode: list[RequestRecord], prompt_tokens: int
                     ) -> tuple[list[list[int]], list[bool]] | None:
        """Draft tokens for each decode lane, and whether the draft model fills them (None: none speculates),
        within KV room and the job's token limit."""
        spec = self.spec
        if not spec.verify or not decode or len(decode) > spec.max_batch_lanes:
            return None
        limit = self.model.mixed_batch_tokens or (1 << 30)
        used = prompt_tokens + len(decode)
        plan: list[list[int]] = []
        from_model: list[bool] = []
        max_seq, bs = self.model.max_seq, ch.block_size
        for r in decode:
            ds, by_model = spec.drafts(r, len(decode), min(max_seq - r.committed - 1, limit - used))
            need = r.committed + 1 + len(ds)
            if need > r.reserved:  # room for the drafts: grow without preempting anyone, else draft less
                target = min(max_seq, -(-need // bs) * bs)
                if ch.kv.grow(r.seq_id, target):
                    self._kv_reserved += target - r.reserved
                    r.reserved = target
                ds = ds[:max(0, draft_room(r.committed, r.reserved, max_seq))]
            used += len(ds)
            plan.append(ds)
            from_model.append(by_model and bool(ds))
        return (plan, from_model) if any(plan) else None

    def _launch(self, ch: ChipState, kind: JobKind, decode: list[RequestRecord], prompts: list[PromptChunk],
                batch: int | None, now: float, out: list[Action], steps: int = 1) -> None:
        """The tail every job shares: its lanes (decode lanes first, one token each, then the prompt chunks),
        the record, the requests' moves, the job in flight, then release notices and the job itself.

        `batch`: the compiled decode profile; None, one lane per request.
        """
        job_id = next(self._job_ids)
        kv = ch.kv
        rs = decode + [r for r, _, _ in prompts]
        # a decode lane whose job is still running gets its next step queued: one position further on
        queued = [r.job_id is not None for r in decode] if self._follow else None
        starts = [r.committed for r in decode] if queued is None else \
            [r.committed + q for r, q in zip(decode, queued)]
        ends = [s + steps for s in starts]
        starts += [start for _, start, _ in prompts]
        ends += [end for _, _, end in prompts]
        sampled = [True] * len(decode) + [end == r.prefill_target for r, _, end in prompts]
        lane = self._lane
        queuing = queued is not None and any(queued)
        # speculation only in a plain one-step job (a queued step or a multi-step job has no room for drafts)
        planned = self._plan_drafts(ch, decode, sum(e - s for _, s, e in prompts)) \
            if self.spec.verify and steps == 1 and not queuing else None
        drafts = model_drafts = None
        if planned is None and kind is JobKind.DECODE and all(r.params.constraint is None for r in decode):
            # the common job, one per decode step: packed from columns, no Lane per lane
            toks = [r.tokens[st] for r, st in zip(decode, starts)] if not queuing else \
                [FOLLOW_PREVIOUS if q else r.tokens[st] for r, st, q in zip(decode, starts, queued)]
            view = kv.block_table_view  # not copied: decode_job copies the tables before the KV changes again
            job = decode_job(toks, starts, [view(r.seq_id) for r in decode], [r.sampling for r in decode],
                             job_id=job_id, generation=self.model.generation, batch=batch,
                             table_width=ch.max_blocks_per_seq, decode_steps=steps, follow=self._follow)
        else:
            if planned is None:
                lanes_in = [lane(r, ch, s, e, smp) for r, s, e, smp in zip(rs, starts, ends, sampled)]
                if queuing:
                    lanes_in = [ln._replace(tokens=_FOLLOW) if i < len(queued) and queued[i] else ln
                                for i, ln in enumerate(lanes_in)]
            else:  # a verification job: a prefill-like chunk per speculating lane, one lane per request
                kind, batch = JobKind.PREFILL, None
                drafts = planned[0] + [[]] * len(prompts)
                model_drafts = planned[1] + [False] * len(prompts) if any(planned[1]) else None
                ends = [e + len(ds) for e, ds in zip(ends, drafts)]
                lanes_in = [lane(r, ch, s, e, smp, ds, bool(model_drafts and model_drafts[i]))
                            for i, (r, s, e, smp, ds) in enumerate(zip(rs, starts, ends, sampled, drafts))]
            job = build_job(kind, lanes_in, job_id=job_id, generation=self.model.generation, batch=batch,
                            table_width=ch.max_blocks_per_seq, decode_steps=steps, follow=self._follow)
        turns = self._turns
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
            followable = ch.followable
            for i, r in enumerate(decode):
                rid = r.request_id
                if queued[i]:  # the hand-off: this job takes the lane when the running one commits
                    kv.queue_next(r.seq_id, job_id, ends[i])
                    r.next_job = job_id
                    del followable[rid]
                    self.counters["queued_steps"] += 1
                else:
                    kv.begin_update(r.seq_id, job_id, ends[i])
                    r.job_id = job_id
                    del ready[rid]
                    r.move(S.DECODE_RUNNING)
                    if steps == 1 and drafts is None:
                        self._may_follow(ch, r)
            for r, end in zip(rs[len(decode):], ends[len(decode):]):
                kv.begin_update(r.seq_id, job_id, end)
                r.job_id = job_id
        for r, _, _ in prompts:
            r.move(S.PREFILL_RUNNING)
            if r.t_first_sched is None:
                r.t_first_sched = now
        lanes = [r.request_id for r in rs]
        ch.inflight[job_id] = InflightJob(
            job_id=job_id, kind=kind, lanes=lanes, seq_ids=[r.seq_id for r in rs],
            start_lens=starts, new_lens=ends, sampled=sampled, batch=len(rs) if batch is None else batch,
            submitted_at=now, timeout_at=now + self.config.job_timeout_s, steps=steps,
            drafts=drafts, model_drafts=model_drafts,
        )
        ch.jobs_submitted += 1
        if steps > 1:
            self.counters["multi_step_jobs"] += 1
        if self.tiers is not None:
            self._flush_exports(ch, now, out)  # before the job: it may overwrite a block being exported
        self._release_freed(ch, out)  # before the job: it may reuse a freed block
        out.append(SubmitJob(ch.chip, job, lanes))

    # ------------------------------------------------------------ KV tiers
    def _flush_exports(self, ch: ChipState, now: float, out: list[Action]) -> None:
        """Queue the chip's pending exports as one KV_EXPORT job, ahead of any job that could overwrite them."""
        tiers = self.tiers
        tiers.collect(ch.chip, ch.kv)
        if not ch.in_service:
            return
        job_id = next(self._job_ids)
        job = tiers.export_job(ch.chip, job_id, self.model.generation, now)
        if job is None:
            return
        self._submit_transfer(ch, job, [], [], [], [], now, out)

    def _submit_transfer(self, ch: ChipState, job, lanes: list[int], seq_ids: list[int], starts: list[int],
                         ends: list[int], now: float, out: list[Action]) -> None:
        ch.inflight[job.job_id] = InflightJob(
            job_id=job.job_id, kind=job.kind, lanes=lanes, seq_ids=seq_ids, start_lens=starts, new_lens=ends,
            sampled=[False] * len(lanes), batch=len(lanes), submitted_at=now,
            timeout_at=now + self.config.job_timeout_s)
        ch.transfers += 1
        self.counters[f"{job.kind.name.lower()}_jobs"] += 1
        out.append(SubmitJob(ch.chip, job, lanes))

    def _launch_transfers(self, now: float, out: list[Action]) -> None:
        """Every chip's exports, then the imports planned at admission (an import may reuse an exported block)."""
        for ch in self.chips.values():
            self._flush_exports(ch, now, out)
        imports, self._imports = self._imports, []
        for chip, rid, plan in imports:
            ch = self.chips[chip]
            r = self._requests[rid]
            bs = ch.block_size
            first = r.committed // bs
            end = r.committed + plan.blocks * bs
            job_id = next(self._job_ids)
            job = self.tiers.import_job(chip, job_id, self.model.generation, plan,
                                        ch.kv.block_table_view(r.seq_id)[first:first + plan.blocks], now)
            ch.kv.begin_update(r.seq_id, job_id, end)
            r.job_id = job_id
            r.move(S.PREFILL_RUNNING)
            if r.t_first_sched is None:
                r.t_first_sched = now
            self._release_freed(ch, out)  # before the import: it may write a freed block
            self._submit_transfer(ch, job, [rid], [r.seq_id], [r.committed], [end], now, out)

    def _transfer_result(self, ch: ChipState, job: InflightJob, result: JobResult, now: float,
                         out: list[Action]) -> None:
        ch.transfers -= 1
        fresh = result.generation == self.model.generation and result.kind == job.kind
        ok = fresh and result.status == JobStatus.OK
        refused = fresh and result.status == JobStatus.INVALID
        self.tiers.job_done(job.job_id, ok, refused, now)
        if job.kind is JobKind.KV_EXPORT:
            return
        if ok:
            self._complete_job(ch, job, result, now, out)  # the imported tokens are committed; prefill next
            return
        if not refused:
            self._fail_job(ch, job, "job_failed", "a KV import failed", now, out)
            return
        # Refused whole before any write: the blocks hold what they held; recompute those tokens.
        self.counters["tier_refused_imports"] += 1
        for rid, seq_id in zip(job.lanes, job.seq_ids):
            r = self._requests[rid]
            ch.kv.abort_update(seq_id, job.job_id)
            r.job_id = None
            if r.state in TERMINAL_STATES:
                self._unbind(r, released=True)
                self._forget_if_done(r)
                continue
            r.move(S.PREFILL_READY)
            ch.prefill.push(rid, r.prefill_target - r.committed, front=True)
            r.ready_since = now

    def _release_freed(self, ch: ChipState, out: list[Action]) -> None:
        freed = ch.kv.take_freed()
        if freed:
            out.append(ReleaseBlocks(ch.chip, freed))

    # ----------------------------------------------------------------- stats
    def queue_stats(self, now: float) -> dict[str, dict[str, dict[str, float]]]:
        """Depth and oldest wait of every queue (scheduler_stats.queue_stats), read-only."""
        return queue_stats(now, self._requests, list(self._wfq.ids()) + list(self._requeue), self.chips.values())

    def profile_stats(self) -> dict[int, dict[str, float | int | None]]:
        """Per decode profile: jobs, active lanes, lane slots, lane waste (inactive lanes) and fill ratio."""
        return self.job_counts.profile_stats()

    def stats(self, now: float | None = None) -> dict:
        """Everything an operator may want, as plain data; queue waits only when `now` is given."""
        st = scheduler_stats(
            accepting=self._accepting, admission_blocked=self.admission_blocked, profiles=self.profiles,
            chunked=self.chunked, waiting_requests=len(self._wfq) + len(self._requeue),
            waiting_prompt_tokens=self._waiting_tokens, active_sequences=self._n_bound,
            requests=self._requests.values(), chips=list(self.chips.values()), jobs=self.job_counts,
            tenant_active=self._tenant_active, tenant_service=self.tenant_service,
            generation_tokens=self.generation_tokens, prompt_tokens=self.prompt_tokens,
            queue_waits=None if now is None else self.queue_stats(now),
        ) | ({} if self.tiers is None else {"kv_tiers": self.tiers.stats()})
        st["speculative"] = self.spec.counters.to_dict()
        return st
