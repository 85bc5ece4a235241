"""Test doubles shared by the scheduler tests: a fake clock-free executor and helpers.

`FakeExecutor` plays the workers: it collects SubmitJob actions, checks each
job record is well formed, and answers with JobResults whose tokens are a
pure function of (seed, position) -- like seeded sampling -- in FIFO or a
random order.  It also checks the client-visible contract on every action it
sees: tokens only before the terminal event, exactly one terminal per request.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.core.actions import EmitTokens, FailRequest, FinishRequest, ReleaseBlocks, SubmitJob
from engine.core.requests import GenerateParams
from engine.core.scheduler import ChipSpec, ModelSpec, Scheduler
from engine.core.scheduler_config import SchedulerConfig
from ipc.records import Job, JobKind, JobResult, JobStatus

VOCAB = 1000
EOS = 0


def default_token(seed: int, position: int) -> int:
    """Never EOS (0): generation length is governed by max_tokens unless a test says otherwise."""
    return 1 + (seed * 1_000_003 + position * 7_919) % (VOCAB - 1)


def make_model(profiles=(1, 4, 8, 16), max_seq=2048, chunked=True, generation=1, mixed=0,
               kv_copy=False) -> ModelSpec:
    return ModelSpec(generation=generation, vocab_size=VOCAB, eos_ids=(EOS,), max_seq=max_seq,
                     profiles=tuple(profiles), chunked_prefill=chunked, mixed_batch_tokens=mixed, kv_copy=kv_copy)


def make_scheduler(config: SchedulerConfig | None = None, *, chips=1, num_blocks=512, block_size=16,
                   piece=None, **model_kw) -> Scheduler:
    return Scheduler(config or SchedulerConfig(), make_model(**model_kw),
                     [ChipSpec(c, num_blocks, block_size) for c in range(chips)], piece=piece)


def params(n_prompt=8, max_tokens=4, seed=0, **kw) -> GenerateParams:
    return GenerateParams(prompt=[(seed * 31 + i) % (VOCAB - 1) + 1 for i in range(n_prompt)],
                          max_tokens=max_tokens, seed=seed, **kw)


@dataclass
class FakeExecutor:
    sched: Scheduler
    token_fn: Callable[[int, int], int] = default_token
    rng: random.Random | None = None
    fail_jobs: set[int] = field(default_factory=set)  # job ids answered with FAILED
    pending: list[tuple[int, Job]] = field(default_factory=list)
    jobs: list[tuple[int, Job]] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    terminal: dict[int, FinishRequest | FailRequest] = field(default_factory=dict)
    order: list[tuple[str, int]] = field(default_factory=list)  # ("tokens"|"done", request id)
    texts: dict[int, list[str]] = field(default_factory=dict)  # text deltas (schedulers with a tokenizer)
    released: list[tuple[int, int]] = field(default_factory=list)  # (chip, block) release notices, in order

    def handle(self, actions) -> None:
        for a in actions:
            if isinstance(a, SubmitJob):
                a.job.validate()
                self._check_lanes(a.job)
                self.pending.append((a.chip, a.job))
                self.jobs.append((a.chip, a.job))
            elif isinstance(a, EmitTokens):
                assert a.request_id not in self.terminal, f"tokens after the terminal event of {a.request_id}"
                assert a.tokens or a.text or a.prompt_logprobs, "EmitTokens with neither tokens nor text"
                self.tokens.setdefault(a.request_id, []).extend(a.tokens)
                if a.text is not None:
                    self.texts.setdefault(a.request_id, []).append(a.text)
                self.order.append(("tokens", a.request_id))
            elif isinstance(a, ReleaseBlocks):
                kv = self.sched.chips[a.chip].kv
                for b in a.blocks:  # freed, not kept for the prefix cache (the job after it may reuse it)
                    assert 0 <= b < kv.num_blocks and not kv.cache.is_cached(b), (a, b)
                self.released += [(a.chip, b) for b in a.blocks]
            elif isinstance(a, (FinishRequest, FailRequest)):
                assert a.request_id not in self.terminal, f"second terminal event for {a.request_id}"
                self.terminal[a.request_id] = a
                self.order.append(("done", a.request_id))
            else:  # pragma: no cover
                raise AssertionError(f"unknown action {a!r}")

    @staticmethod
    def _check_lanes(job: Job) -> None:
        for lane in range(job.batch):
            if not job.lane_valid[lane]:
                assert job.context_lens[lane] == 0
                assert np.all(job.block_tables[lane] == -1)
                assert job.query_start[lane + 1] == job.query_start[lane]

    def result_for(self, job: Job, status: JobStatus = JobStatus.OK) -> JobResult:
        toks = np.full(job.batch, -1, np.int32)
        for lane in range(job.batch):
            if job.lane_valid[lane] and job.sample[lane]:
                toks[lane] = self.token_fn(int(job.seed[lane]), int(job.context_lens[lane]))
        return JobResult(job_id=job.job_id, generation=job.generation, kind=job.kind, status=status,
                         tokens=toks, logprobs=np.full(job.batch, -0.5, np.float32))

    def complete_one(self, now: float, index: int = 0) -> None:
        chip, job = self.pending.pop(index)
        status = JobStatus.FAILED if job.job_id in self.fail_jobs else JobStatus.OK
        self.handle(self.sched.on_result(chip, self.result_for(job, status), now))

    def complete_all(self, now: float) -> None:
        while self.pending:
            idx = self.rng.randrange(len(self.pending)) if self.rng else 0
            self.complete_one(now, idx)

    def step(self, now: float) -> None:
        """tick, then answer every job that tick submitted."""
        self.handle(self.sched.tick(now))
        self.complete_all(now)

    def run(self, now: float = 0.0, dt: float = 0.01, max_steps: int = 100_000) -> float:
        """Drive until the scheduler is idle; returns the fake time reached."""
        for _ in range(max_steps):
            if not self.sched.has_work():
                return now
            self.step(now)
            now += dt
        raise AssertionError("scheduler did not become idle")

    def submit(self, rid: int, p: GenerateParams, now: float = 0.0) -> None:
        self.handle(self.sched.submit(rid, p, now))


def kv_fully_free(sched: Scheduler) -> bool:
    for ch in sched.chips.values():
        ch.kv.check_invariants()
        if ch.kv.available_blocks() != ch.num_blocks or ch.kv.seq_ids():
            return False
    return True


def decode_turn_gaps(jobs: list[tuple[int, Job]]) -> dict[int, int]:
    """Per lane seed: the most decode jobs submitted between two of its steps (1: it was in every one)
    -- how long a ready lane waited for its turn, counted in jobs."""
    seen: dict[int, list[int]] = {}
    decodes = [job for _, job in jobs if job.kind == JobKind.DECODE]
    for i, job in enumerate(decodes):
        for lane in range(job.batch):
            if job.lane_valid[lane]:
                seen.setdefault(int(job.seed[lane]), []).append(i)
    return {seed: max((b - a for a, b in zip(at, at[1:])), default=len(decodes)) for seed, at in seen.items()}
