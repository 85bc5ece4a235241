"""The scheduler's one state object, shared by its parts, and the read-only view tests and tools read it by.

Every part of the scheduler (admission, job building, launch, completion,
output, lifecycle, KV-tier jobs) reads and writes this one dataclass: there is
exactly one owner of each request, queue and job in flight (the single-thread
actor), and a reader of the code finds every piece of it here. Parts never
copy a field that a reload changes (`config`, `budget`, `planner`): they read
it from here each time.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from engine.config_schema import ConfigError
from engine.core.batch_planner import BatchPlanner
from engine.core.batch_profiles import resolve_profiles
from engine.core.chip_state import ChipState
from engine.core.fair_queue import WeightedFairQueue
from engine.core.inflight_governor import GovernorPolicy, InflightGovernor
from engine.core.kv import KvManager
from engine.core.prefill_queues import PrefillQueues, SmoothWeightedRoundRobin, WorkClass
from engine.core.request_record import RequestRecord
from engine.core.retry_after import QueueDrainRate
from engine.core.scheduler_config import SchedulerConfig
from engine.core.scheduler_stats import JobCounts
from engine.core.sched.admission_rules import CapacityBudget, ModelLimits
from engine.core.spec.planner import SpecPlanner
from engine.core.tier_transfers import ImportPlan, KvTiers


def block_end(n: int, block_size: int, max_seq: int) -> int:
    """n tokens rounded up to whole blocks, at most max_seq: the KV room a sequence of n tokens holds."""
    return min(max_seq, -(-n // block_size) * block_size)


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
    lora_slots: int = 0  # LoRA adapters a job's lanes may name (the chips' device slots); 0 = none
    lora_mixed: bool = True  # lanes of different adapters may share a job; False: jobs grouped by adapter
    kv_copy: bool = False  # the backend copies KV blocks on the device (KV_COPY jobs): choices fork by copy
    lane_imports: bool = False  # the workers run tier imports carried in a prefill job (describe().extra)


@dataclass(eq=False)
class SchedState:
    config: SchedulerConfig
    model: ModelSpec
    profiles: tuple[int, ...]
    chunked: bool
    planner: BatchPlanner
    queue_next_step: bool  # queued next steps (executor.queue_next_step): decode jobs only
    spec: SpecPlanner
    piece: Callable[[int], bytes] | None  # the tokenizer's bytes of a token (None: token ids only)
    chips: dict[int, ChipState]
    tpot_watch: bool  # the governor watches decode intervals (a ping/pong TPOT regression)
    limits: ModelLimits
    budget: CapacityBudget
    wfq: WeightedFairQueue
    tiers: KvTiers | None
    counters: Counter[str]
    job_counts: JobCounts  # per-job counters, kept in `counters`
    requests: dict[int, RequestRecord] = field(default_factory=dict)
    requeue: deque[int] = field(default_factory=deque)  # preempted / faulted: admitted again before the fair queue
    deadlines: list[tuple[float, int]] = field(default_factory=list)  # a heap of (deadline, request id)
    job_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    seq_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    admit_order: itertools.count = field(default_factory=lambda: itertools.count(1))
    # decode turns (RequestRecord.decode_key): one at admission, then one each time a lane gets a step
    turns: itertools.count = field(default_factory=lambda: itertools.count(1))
    waiting_tokens: int = 0
    tenant_waiting_tokens: Counter[str] = field(default_factory=Counter)
    tenant_active: Counter[str] = field(default_factory=Counter)
    n_bound: int = 0
    kv_reserved: int = 0  # KV tokens reserved by the bound sequences (RequestRecord.reserved)
    accepting: bool = True
    unavailable_reason: str = "draining"
    reopen_at: float | None = None  # a drain's deadline: when a request refused by it may come back
    drain_rate: QueueDrainRate = field(default_factory=QueueDrainRate)  # how fast the waiting queue empties
    dirty: bool = False
    window_wakeup: float | None = None
    # (event, chip, reason): what the shell logs (a ping/pong downgrade); drained by take_notices()
    notices: list[tuple[str, int, str]] = field(default_factory=list)
    generation_tokens: int = 0  # tokens sampled (plain ints: bumped once per generated token)
    prompt_tokens: int = 0  # prompt tokens of requests that sampled their first token
    # why the waiting queue's head was not admitted at the last tick: None (nobody waits),
    # "kv" (no chip has room), "max_sequences", "tenant_cap", "static_batching"
    admission_blocked: str | None = None
    tenant_service: Counter[str] = field(default_factory=Counter)  # tokens computed per tenant
    imports: list[tuple[int, int, ImportPlan]] = field(default_factory=list)  # (chip, rid, plan) not launched
    # with model.lane_imports: rid -> the plan its first prefill job carries (engine/core/tier_jobs.py)
    lane_imports: dict[int, ImportPlan] = field(default_factory=dict)

    @classmethod
    def create(cls, config: SchedulerConfig, model: ModelSpec, chips: list[ChipSpec],
               piece: Callable[[int], bytes] | None, tiers: KvTiers | None) -> SchedState:
        if not chips:
            raise ConfigError("at least one chip is required")
        if len({c.chip for c in chips}) != len(chips):
            raise ConfigError("chip ids must be unique")
        if model.max_seq < 2 or model.vocab_size < 1:
            raise ConfigError("model max_seq must be >= 2 and vocab_size >= 1")
        for c in chips:
            if c.num_blocks < 1 or c.block_size < 1:
                raise ConfigError(f"chip {c.chip}: num_blocks and block_size must be >= 1")
        profiles = resolve_profiles(config.profiles, model.profiles)
        chunked = bool(config.chunked_prefill and model.chunked_prefill)
        planner = BatchPlanner(config, profiles, chunked, model.mixed_batch_tokens)
        weights = {
            WorkClass.DECODE: config.decode_weight,
            WorkClass.SHORT: config.short_prefill_weight,
            WorkClass.MEDIUM: config.medium_prefill_weight,
            WorkClass.LONG: config.long_prefill_weight,
        }
        policy = GovernorPolicy(max_inflight=config.max_inflight, timeouts=config.downgrade_timeouts,
                                tpot_regression=config.downgrade_tpot_p99_ratio, window=config.downgrade_window,
                                min_gain=config.pingpong_min_gain, gain_window=config.pingpong_gain_window)
        states = {c.chip: ChipState(
            chip=c.chip, num_blocks=c.num_blocks, block_size=c.block_size,
            max_blocks_per_seq=math.ceil(model.max_seq / c.block_size),
            kv=KvManager(c.chip, c.num_blocks, c.block_size, model.max_seq, prefix_cache=config.prefix_cache),
            prefill=PrefillQueues(config.short_prefill_max_tokens, config.medium_prefill_max_tokens),
            wrr=SmoothWeightedRoundRobin(weights), governor=InflightGovernor(policy),
        ) for c in chips}
        pool = sum(c.num_blocks * c.block_size for c in chips)
        counters: Counter[str] = Counter()
        st = cls(
            config=config, model=model, profiles=profiles, chunked=chunked, planner=planner,
            # a mixed job's lanes take prompts as they come: no queued next steps there
            queue_next_step=bool(config.queue_next_step and not planner.mixed_budget),
            spec=SpecPlanner(config.spec_method, config.spec_max_draft_tokens, config.spec_max_batch_lanes,
                             model.spec_verify, draft_model=model.spec_draft, k_choice=config.spec_k_choice),
            piece=piece, chips=states, tpot_watch=policy.tpot_regression > 0 and policy.max_inflight > 1,
            limits=ModelLimits(vocab_size=model.vocab_size, max_seq=model.max_seq,
                               max_blocks_per_chip=max(c.num_blocks for c in chips),
                               block_size=min(c.block_size for c in chips)),
            budget=CapacityBudget(
                max_sequences=config.max_sequences,
                # admission.max_kv_tokens counts only below the pool: the pool itself is the chips' own limit
                max_kv_tokens=config.max_kv_tokens if 0 < config.max_kv_tokens < pool else None,
                max_waiting_requests=config.max_waiting_requests,
                max_waiting_prompt_tokens=config.max_waiting_prompt_tokens,
                max_inflight_jobs=config.max_inflight * len(chips),
                max_queue_wait_s=config.max_queue_wait_s,
            ),
            wfq=WeightedFairQueue(lambda t: st.config.tenant(t).weight), tiers=tiers,
            counters=counters, job_counts=JobCounts(counters, profiles),
        )
        if tiers is not None:
            for ch in states.values():
                tiers.attach(ch.kv)
        return st

    def note_downgraded(self, ch: ChipState) -> None:
        """The chip's governor just downgraded ping/pong: count it and tell the shell (take_notices)."""
        reason = ch.governor.downgraded
        assert reason is not None
        self.counters["inflight_downgrades"] += 1
        self.counters[f"inflight_downgrades_{reason.value}"] += 1
        self.notices.append(("inflight_downgraded", ch.chip, reason.value))


class SchedView:
    """What tests and tools may read of the scheduler's requests and tenants, without reaching into its state."""

    __slots__ = ("_st", "requests")

    def __init__(self, st: SchedState) -> None:
        self._st = st
        self.requests: Mapping[int, RequestRecord] = MappingProxyType(st.requests)  # live, read-only

    def request(self, request_id: int) -> RequestRecord | None:
        return self._st.requests.get(request_id)

    def tenant_active(self, tenant: str) -> int:
        """Sequences the tenant holds (admitted and bound to a chip)."""
        return self._st.tenant_active[tenant]
