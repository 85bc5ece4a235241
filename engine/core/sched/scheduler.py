"""The sans-I/O scheduler: events plus `now` in, actions out.

One object owns every request, queue, KV manager and job in flight of a
board, and is driven by a single thread, so its state needs no lock and
every event sees the one before it whole.  It never sleeps, reads a clock or
touches a socket: the I/O shell
(or the simulator, or a test) calls submit/cancel/on_result/tick with the
current time and carries out the returned actions.

Lifecycle of a request: submit -> WAITING_ADMISSION (weighted fair queue) ->
PREFILL_READY once KV is reserved on a chip -> PREFILL_RUNNING (one job per
chunk) -> DECODE_READY <-> DECODE_RUNNING (continuous batching) -> COMPLETED,
or CANCELLED / FAILED from anywhere.  A request whose terminal event has been
emitted while one of its jobs is still on the chip keeps its KV until that
job drains (a running job cannot be recalled and writes the lane's blocks
until it ends; its result for the lane is dropped).

This class is the order of work; the work is in its parts, which share one
`SchedState`: admission (`admission.py`), job plans (`job_builder.py`) and
their launch (`launch.py`), results (`completion.py`) and the tokens they
stream (`output.py`), how requests end (`lifecycle.py`), and the KV-tier jobs
(`engine/core/tier_jobs.py`).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import Counter
from collections.abc import Callable

from engine.core.actions import Action, FailRequest, FinishRequest
from engine.core.batch_planner import BatchPlanner
from engine.core.chip_state import ChipState
from engine.core.logprob_asks import sampling_want
from engine.core.request_record import RequestRecord
from engine.core.requests import GenerateParams, RequestState
from engine.core.retry_after import QueueDrainRate
from engine.core.scheduler_config import SchedulerConfig
from engine.core.scheduler_stats import JobCounts, queue_stats, scheduler_stats
from engine.core.sched.admission import Admission
from engine.core.sched.admission_rules import CapacityBudget, ModelLimits
from engine.core.sched.choice_fork import ChoiceForks
from engine.core.sched.choices import HeldChoices, choice_params
from engine.core.sched.completion import Completion
from engine.core.sched.job_builder import JobBuilder
from engine.core.sched.launch import Launcher
from engine.core.sched.lifecycle import TRANSFERS, Lifecycle
from engine.core.sched.output import Output
from engine.core.sched.state import ChipSpec, ModelSpec, SchedState, SchedView
from engine.core.spec.planner import SpecPlanner
from engine.core.stop_conditions import StopChecker, StopReason
from engine.core.text_stream import TextStream
from engine.core.tier_jobs import TierJobs
from engine.core.tier_transfers import KvTiers
from ipc.records import JobKind, JobResult, JobStatus

__all__ = ["ChipSpec", "ModelSpec", "Scheduler", "SchedulerConfig"]

S = RequestState


class _FromState:
    """A public attribute of the scheduler that is its state's field of the same name (read-only unless
    `writable`): callers keep reading `sched.counters`, `sched.chips`, ... while the parts share the state."""

    def __init__(self, *, writable: bool = False, doc: str | None = None) -> None:
        self.writable = writable
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj._st, self.name)

    def __set__(self, obj, value) -> None:
        if not self.writable:
            raise AttributeError(f"Scheduler.{self.name} is read-only")
        setattr(obj._st, self.name, value)


class Scheduler:
    def __init__(self, config: SchedulerConfig, model: ModelSpec, chips: list[ChipSpec], *,
                 piece: Callable[[int], bytes] | None = None, tiers: KvTiers | None = None) -> None:
        """`tiers`: the host/disk KV tiers below the chips (None: KV never leaves a chip).

        `piece(token_id)` is the tokenizer's bytes of a token: with it every request's output is also
        decoded to text (and may stop on strings); without it (no tokenizer) requests get token ids only."""
        st = self._st = SchedState.create(config, model, chips, piece, tiers)
        self.view = SchedView(st)
        self._admission = Admission(st)
        self._lifecycle = Lifecycle(st, self._admission)
        self._output = Output(st, self._admission, self._lifecycle)
        self._completion = Completion(st, self._admission, self._lifecycle, self._output)
        self._tier_jobs = TierJobs(st, self._admission, self._lifecycle, self._completion)
        self._builder = JobBuilder(st, self._admission)
        self._launcher = Launcher(st, self._tier_jobs)
        self._held = HeldChoices()  # choices of n > 1 requests waiting for their leader's prompt (choices.py)
        self._forks = ChoiceForks(st, self._admission, self._lifecycle)  # released choices take the leader's KV

    # ------------------------------------------------------------------ events
    def submit(self, request_id: int, params: GenerateParams, now: float) -> list[Action]:
        st = self._st
        assert request_id not in st.requests, f"request id {request_id} is already live"
        refused = self._admission.refusal(request_id, params, now)
        if refused is not None:
            return [refused]
        if params.stop_strings and st.piece is None:
            st.counters["rejected_no_tokenizer"] += 1
            st.counters["rejected"] += 1
            return [FailRequest(request_id, 400, "no_tokenizer", "stop: string stops need the model's tokenizer "
                                "and this model has none; use token-id stop sequences", False)]
        stop = StopChecker.build(params.max_tokens, tuple(st.model.eos_ids), params.ignore_eos,
                                 params.stop_token_ids, params.stop, params.continuation,
                                 0 if params.penalties is None else params.penalties.min_tokens)
        deadline_s = params.deadline_ms / 1000.0 if params.deadline_ms is not None else st.config.default_deadline_s
        r = RequestRecord(
            request_id=request_id, params=params, arrival=now,
            deadline=None if deadline_s is None else now + deadline_s,
            stop=stop, tokens=[int(t) for t in params.prompt] + [int(t) for t in params.continuation],
            sampling=(params.temperature, params.top_p, params.top_k, params.seed & 0xFFFFFFFFFFFFFFFF,
                      sampling_want(params.logprobs, params.top_logprobs)),
        )
        st.counters["accepted"] += 1
        if st.piece is not None:
            r.text = TextStream(params.stop_strings, 0 if params.penalties is None else params.penalties.min_tokens)
            # The continuation was shown by another server: replay it so held text carries over.
            if r.text.prime(st.piece(int(t)) for t in params.continuation):
                return self._lifecycle.finish_now(r, StopReason.STOP.value, now)
        if stop.exhausted() and params.prompt_logprobs is None:  # max_tokens used up: nothing to compute
            return self._lifecycle.finish_now(r, StopReason.LENGTH.value, now)
        self._admission.enqueue(r)
        return []

    def submit_choices(self, request_ids: list[int], params: GenerateParams, now: float) -> list[Action]:
        """A request with n = len(request_ids) choices, choice k as request request_ids[k] (engine/core/sched/
        choices.py): the others start once choice 0 has computed the prompt, and share its KV blocks."""
        per = choice_params(params, len(request_ids))
        out = self.submit(request_ids[0], per[0], now)
        if out and isinstance(out[0], FailRequest) and request_ids[0] not in self._st.requests:
            # refused at the door: every choice is, the same way (a client or balancer may then retry it whole)
            return out + [dataclasses.replace(out[0], request_id=rid) for rid in request_ids[1:]]
        self._st.counters["choices_forked"] += len(request_ids) - 1
        self._held.hold(request_ids[0], list(zip(request_ids[1:], per[1:])))
        return self._release_choices(now, out)

    def _release_choices(self, now: float, out: list[Action], everything: bool = False) -> list[Action]:
        if self._held:
            for leader, rid, p in self._held.due(self._st.requests, everything):
                out += self.submit(rid, p, now)
                if not everything:
                    self._forks.released(leader, rid)
        return out

    def cancel(self, request_id: int, now: float) -> list[Action]:
        st = self._st
        held = self._held.drop(request_id) if self._held else None
        if held is not None:  # a choice not started yet: it ends here, having computed nothing
            st.counters["cancelled"] += 1
            st.counters["finished_cancelled"] += 1
            usage = {"prompt_tokens": len(held.prompt), "completion_tokens": 0, "cached_tokens": 0}
            return [FinishRequest(request_id, "cancelled", usage, {"ttft_ms": None, "tpot_ms": None, "e2e_ms": None})]
        r = st.requests.get(request_id)
        if r is None or r.terminal:
            return []
        st.counters["cancelled"] += 1
        st.counters["finished_cancelled"] += 1
        out: list[Action] = [FinishRequest(request_id, "cancelled", r.usage(), r.timing(now))]
        self._lifecycle.terminate(r, S.CANCELLED)
        return out

    def on_result(self, chip: int, result: JobResult, now: float) -> list[Action]:
        st = self._st
        ch = st.chips.get(chip)
        job = None if ch is None else ch.inflight.pop(result.job_id, None)
        if job is None:
            st.counters["stale_results"] += 1  # unknown, timed out or from before a fault
            return []
        assert ch is not None
        st.dirty = True
        out: list[Action] = []
        if st.tiers is not None and st.tiers.has_lane_imports(job.job_id) \
                and self._tier_jobs.lane_imports_result(ch, job, result, now, out):
            return self._release_choices(now, out)
        if job.kind in TRANSFERS:
            self._tier_jobs.transfer_result(ch, job, result, now, out)
        elif job.kind is JobKind.KV_COPY:
            self._forks.result(ch, job, result, now, out)
        elif result.generation != st.model.generation or result.kind != job.kind \
                or result.tokens.shape[0] != job.batch:
            st.counters["stale_results"] += 1
            if ch.governor.on_crosstalk():  # with two jobs in flight, the answer may be the other job's
                st.note_downgraded(ch)
            self._lifecycle.fail_job(ch, job, "stale_result", "the job's result did not match its generation",
                                     now, out)
        elif result.status != JobStatus.OK:
            st.counters["failed_jobs"] += 1
            if ch.governor.on_status_anomaly():
                st.note_downgraded(ch)
            reason = "job_invalid" if result.status == JobStatus.INVALID else "job_failed"
            self._lifecycle.fail_job(ch, job, reason, f"the chip reported {result.status.name}", now, out)
        elif job.steps > 1:
            self._completion.complete_steps(ch, job, result, now, out)
        else:
            self._completion.complete_job(ch, job, result, now, out)
        return self._release_choices(now, out)

    def on_chip_down(self, chip: int, now: float) -> list[Action]:
        return self._lifecycle.chip_down(chip, now)

    def on_chip_up(self, chip: int, now: float) -> list[Action]:
        st = self._st
        ch = st.chips[chip]
        out: list[Action] = []
        if ch.in_service:  # a restart we did not see going down
            out += self.on_chip_down(chip, now)
        ch.kv.recover_chip()
        ch.in_service = True
        st.dirty = True
        return out

    def tick(self, now: float) -> list[Action]:
        """The order of work: expiry, admission, KV-tier transfers, then each chip's jobs, planned and launched
        one by one (each plan sees what the jobs before it took)."""
        st = self._st
        out: list[Action] = []
        life = self._lifecycle
        life.expire_deadlines(now, out)
        life.expire_queue_waits(now, out)
        life.expire_jobs(now, out)
        self._release_choices(now, out)
        self._admission.admit(now)
        if st.tiers is not None:
            self._tier_jobs.launch_transfers(now, out)
        self._forks.launch(now, out)
        st.window_wakeup = None
        plans, launch = self._builder.plans, self._launcher.launch
        for ch in st.chips.values():
            for plan in plans(ch, now):
                launch(ch, plan, now, out)
        st.dirty = False
        return out

    def next_wakeup(self, now: float) -> float | None:
        st = self._st
        if st.dirty and self.has_work():
            return now
        times: list[float] = []
        while st.deadlines:
            t, rid = st.deadlines[0]
            r = st.requests.get(rid)
            if r is None or r.terminal or r.deadline != t:
                heapq.heappop(st.deadlines)
                continue
            times.append(t)
            break
        bound = st.budget.max_queue_wait_s
        if bound > 0:
            head = st.wfq.oldest()
            if head is not None:
                times.append(st.requests[head].arrival + bound)
        for ch in st.chips.values():
            times.extend(j.timeout_at for j in ch.inflight.values())
        if st.window_wakeup is not None:
            times.append(st.window_wakeup)
        return min(times) if times else None

    def reenable_inflight(self, chip: int | None = None) -> list[int]:
        """The operator's re-enable of ping/pong after a downgrade (all chips, or one); the chips it restored."""
        st = self._st
        done = []
        for ch in st.chips.values():
            if (chip is None or ch.chip == chip) and ch.governor.reenable():
                done.append(ch.chip)
                st.counters["inflight_reenabled"] += 1
        st.dirty = True
        return done

    def take_notices(self) -> list[tuple[str, int, str]]:
        """Events for the shell since the last call: ("inflight_downgraded", chip, reason) to log, and
        ("chip_hung", chip, "job_timeout"): the core took the chip down; the shell restarts its worker."""
        st = self._st
        out, st.notices = st.notices, []
        return out

    def set_accepting(self, accepting: bool, reason: str = "draining", reopen_at: float | None = None) -> None:
        """`reopen_at`: when admission is expected back (a drain's deadline), for the refusals' retry_after_ms."""
        st = self._st
        st.accepting = bool(accepting)
        st.unavailable_reason = reason
        st.reopen_at = None if accepting else reopen_at

    # Settings baked into per-chip state at construction; a reload must leave them alone.
    _FIXED_SETTINGS = ("profiles", "profile_fill_ratio", "chunked_prefill", "max_inflight", "prefix_cache",
                       "decode_weight", "short_prefill_weight", "medium_prefill_weight", "long_prefill_weight",
                       "short_prefill_max_tokens", "medium_prefill_max_tokens", "static_batching", "max_kv_tokens",
                       "queue_next_step", "decode_steps", "downgrade_timeouts", "downgrade_tpot_p99_ratio", "downgrade_window",
                       "pingpong_min_gain", "pingpong_gain_window")

    def reconfigure(self, config: SchedulerConfig) -> None:
        """Take new admission budgets, tenant policies, deadlines and windows (a SIGHUP reload).

        Applies to what happens next: requests already admitted keep their
        deadline and lanes; a lower `max_sequences` only stops new admissions.
        """
        st = self._st
        for name in self._FIXED_SETTINGS:
            assert getattr(config, name) == getattr(st.config, name), f"{name} cannot change without a restart"
        st.config = config
        st.budget = dataclasses.replace(
            st.budget, max_sequences=config.max_sequences, max_waiting_requests=config.max_waiting_requests,
            max_waiting_prompt_tokens=config.max_waiting_prompt_tokens, max_queue_wait_s=config.max_queue_wait_s)
        st.planner = BatchPlanner(config, st.profiles, st.chunked, st.model.mixed_batch_tokens)
        st.dirty = True

    def shutdown(self, now: float) -> list[Action]:
        """Admission closes and every live request gets 503 "shutdown" (retryable: a balancer resumes it)."""
        self.set_accepting(False, "shutdown")
        return self.end_live(now, "the server is shutting down")

    def end_live(self, now: float, message: str) -> list[Action]:
        """Every live request gets 503 "shutdown" (retryable), e.g. when an admin drain's time is up.

        Jobs still on a chip keep their KV until their results drain (or the
        chip is declared down); everything else is released at once.
        """
        out = self._release_choices(now, [], everything=True)  # held choices end with the live ones
        return out + self._lifecycle.end_live(now, message)

    def has_work(self) -> bool:
        st = self._st
        return bool(st.requests) or bool(self._held) or any(ch.inflight for ch in st.chips.values())

    # ----------------------------------------------------------------- stats
    def queue_stats(self, now: float) -> dict[str, dict[str, dict[str, float]]]:
        """Depth and oldest wait of every queue (scheduler_stats.queue_stats), read-only."""
        st = self._st
        return queue_stats(now, st.requests, list(st.wfq.ids()) + list(st.requeue), st.chips.values())

    def profile_stats(self) -> dict[int, dict[str, float | int | None]]:
        """Per decode profile: jobs, active lanes, lane slots, lane waste (inactive lanes) and fill ratio."""
        return self._st.job_counts.profile_stats()

    def stats(self, now: float | None = None) -> dict:
        """Everything an operator may want, as plain data; queue waits only when `now` is given."""
        st = self._st
        out = scheduler_stats(
            accepting=st.accepting, admission_blocked=st.admission_blocked, profiles=st.profiles,
            chunked=st.chunked, waiting_requests=len(st.wfq) + len(st.requeue),
            waiting_prompt_tokens=st.waiting_tokens, active_sequences=st.n_bound,
            requests=st.requests.values(), chips=list(st.chips.values()), jobs=st.job_counts,
            tenant_active=st.tenant_active, tenant_service=st.tenant_service,
            generation_tokens=st.generation_tokens, prompt_tokens=st.prompt_tokens,
            queue_waits=None if now is None else self.queue_stats(now),
        ) | ({} if st.tiers is None else {"kv_tiers": st.tiers.stats()})
        out["speculative"] = {**st.spec.counters.to_dict(), "k_choice": st.spec.k_choice,
                              "step_cost": st.spec.step_cost.table()}
        return out

    # ------------------------------------------------- read-only public state
    config: SchedulerConfig = _FromState(doc="the settings in force (reconfigure replaces them)")
    model: ModelSpec = _FromState()
    profiles: tuple[int, ...] = _FromState(doc="the compiled decode batches in use")
    chunked: bool = _FromState()
    planner: BatchPlanner = _FromState()
    spec: SpecPlanner = _FromState()
    limits: ModelLimits = _FromState()
    tiers: KvTiers | None = _FromState()
    chips: dict[int, ChipState] = _FromState()
    budget: CapacityBudget = _FromState()
    counters: Counter[str] = _FromState()
    job_counts: JobCounts = _FromState()
    notices: list[tuple[str, int, str]] = _FromState()
    admission_blocked: str | None = _FromState(doc="why the waiting queue's head was not admitted at the last tick")
    tenant_service: Counter[str] = _FromState()
    generation_tokens: int = _FromState()
    prompt_tokens: int = _FromState()
    drain_rate: QueueDrainRate = _FromState(writable=True, doc="how fast the waiting queue empties (retry_after_ms)")
