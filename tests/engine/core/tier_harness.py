"""An in-process board for the KV-tier tests: the scheduler core driving real `ref` backends.

Each chip is a `RefBackend` with a small device pool; transfer jobs go
through the worker's own code (`workers.execute_job.execute_job`, `HostKv`) into a
real shared-memory slot pool and real block files, so what is tested is the
bytes that move, not a model of them. Jobs run in submission order per chip,
as a worker runs its ring.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest

from engine.core.actions import FailRequest, FinishRequest, SubmitJob
from engine.core.kv.tier_policy import PromoteMode, TierPolicy, TransferCost
from engine.core.requests import GenerateParams
from engine.core.scheduler import ChipSpec, ModelSpec, Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.core.tier_transfers import KvTiers
from ipc.kv_slots import KvSlotPool, record_bytes
from ipc.records import Job, JobResult
from workers.backends.ref import RefBackend
from workers.kv_transfer import HostKv
from workers.execute_job import execute_job


def model_tag(info) -> str:
    return f"{HostKv.__name__}:{info.model_sha256}:{info.kv.block_size}:{info.kv.num_layers}"


@dataclass
class Board:
    chips: int = 1
    num_blocks: int = 8
    host_slots: int = 64
    disk_dir: str | None = None
    disk_blocks: int = 0
    mode: PromoteMode = PromoteMode.ALWAYS
    write_through: bool = True
    tiers_on: bool = True
    lane_imports: bool = False  # the workers take imports inside prefill jobs (ipc.lane_imports)
    mixed_batch_tokens: int = 0  # > 0: a prefill job may carry several prompts
    config: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        self.backends = []
        for c in range(self.chips):
            b = RefBackend(num_blocks=self.num_blocks, chip_id=c)
            b.load(None)
            self.backends.append(b)
        info = self.backends[0].describe()
        self.info = info
        self.pool = None
        if self.tiers_on and self.host_slots:
            self.pool = KvSlotPool.create("npuservetest", "0", self.host_slots, record_bytes(info.kv.block_bytes()))
        self.host_kv = [HostKv(self.pool, b, b.describe(), self.disk_dir) if self.tiers_on else None
                        for b in self.backends]
        self.tiers = None
        if self.tiers_on:
            cost = info.kv_transfer
            self.tiers = KvTiers(model_tag(info), info.kv.block_size, host_slots=self.host_slots,
                                 disk_blocks=self.disk_blocks, block_bytes=info.kv.block_bytes(),
                                 policy=TierPolicy(self.mode, TransferCost(cost.base_s, cost.per_block_s,
                                                                           cost.prefill_s_per_token)),
                                 write_through=self.write_through)
        model = ModelSpec(generation=1, vocab_size=info.vocab_size, eos_ids=tuple(info.eos_ids),
                          max_seq=info.max_seq, profiles=tuple(p.batch for p in info.profiles),
                          chunked_prefill=info.chunked_prefill, lane_imports=self.lane_imports,
                          mixed_batch_tokens=self.mixed_batch_tokens)
        self.sched = Scheduler(self.config, model, [ChipSpec(c, self.num_blocks, info.kv.block_size)
                                                    for c in range(self.chips)], tiers=self.tiers)
        for ch in self.sched.chips.values():
            ch.kv.paranoid = True
        self.queues: list[deque] = [deque() for _ in range(self.chips)]
        self.tokens: dict[int, list[int]] = {}
        self.terminal: dict[int, FinishRequest | FailRequest] = {}
        self.submitted: dict[int, tuple[int, int]] = {}  # request -> (prompt length, max_tokens), for the checks
        self.kinds: list[tuple[int, str]] = []
        self.jobs: list[tuple[int, Job]] = []  # (chip, job) as submitted
        self.now = 0.0
        self.refuse_next: dict[int, int] = {}  # chip -> jobs to drop unanswered (a worker that dies)

    def handle(self, actions) -> None:
        for a in actions:
            if isinstance(a, SubmitJob):
                a.job.validate()
                job = Job.from_arrays(a.job.to_arrays())  # what crosses the ring
                self.queues[a.chip].append(job)
                self.kinds.append((a.chip, a.job.kind.name))
                self.jobs.append((a.chip, a.job))
            elif isinstance(a, FinishRequest | FailRequest):
                assert a.request_id not in self.terminal
                self.terminal[a.request_id] = a
            elif hasattr(a, "tokens") and hasattr(a, "request_id"):
                self.tokens.setdefault(a.request_id, []).extend(a.tokens)

    def submit(self, rid: int, prompt: list[int], max_tokens: int = 6, **kw) -> None:
        self.submitted[rid] = (len(prompt), max_tokens)
        self.handle(self.sched.submit(rid, GenerateParams(prompt=prompt, max_tokens=max_tokens, **kw), self.now))

    def step(self) -> bool:
        self.now += 0.001
        self.handle(self.sched.tick(self.now))
        progressed = False
        for chip, q in enumerate(self.queues):
            if not q:
                continue
            job = q.popleft()
            out = execute_job(self.backends[chip], job, 0.0, self.host_kv[chip])
            res = JobResult(job.job_id, job.generation, job.kind, out.status, out.tokens, out.logprobs,
                            refused=(out.extra or {}).get("refused"))
            res = JobResult.from_arrays(res.to_arrays())  # what crosses the ring back
            self.handle(self.sched.on_result(chip, res, self.now))
            progressed = True
        return progressed

    def run(self, max_steps: int = 20_000) -> None:
        for _ in range(max_steps):
            progressed = self.step()
            if not progressed and not self.sched.has_work():
                break
        else:
            raise AssertionError("board did not go idle")
        self.handle(self.sched.tick(self.now))

    def check_idle(self) -> None:
        for ch in self.sched.chips.values():
            ch.kv.check_invariants()
            assert not ch.inflight and ch.transfers == 0
            assert ch.kv.pool.num_quarantined() == 0
        if self.tiers is not None:
            for tier in (self.tiers.host, self.tiers.disk):
                if tier is not None:
                    tier.check_invariants()
                    assert all(e.readers == 0 for e in (tier.entry(c) for c in tier.chains()))
                    assert tier.pending_count() == 0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.unlink()


@pytest.fixture
def boards():
    """Boards made by a test (`boards(**kw)`), each closed after it."""
    made = []

    def make(**kw):
        b = Board(**kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()
