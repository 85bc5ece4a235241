"""executor.decode_steps: the worker runs n decode steps per job; outputs equal the one-step run."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from engine.core.scheduler_config import SchedulerConfig
from ipc.records import Job, JobKind, JobResult, JobStatus
from test_scheduler_queued_step import BS, FollowingExecutor, chained_token, outcome, pipelined, workload
from test_scheduler_fakes import kv_fully_free, make_scheduler, params
from test_scheduler_mixed import lanes_of
from test_scheduler_text import piece
from workers.multi_step import next_step


@dataclass
class StepsExecutor(FollowingExecutor):
    """Answers a multi-step decode job as the worker does: step k+1 fed the token step k sampled."""

    def result_for(self, job: Job, status: JobStatus = JobStatus.OK) -> JobResult:
        if job.decode_steps <= 1 or status != JobStatus.OK:
            return super().result_for(job, status)
        assert job.kind == JobKind.DECODE
        rows, step = [], job
        for _ in range(job.decode_steps):
            for lane in range(step.batch):  # the scheduler gave every lane KV room for all n positions
                if step.lane_valid[lane]:
                    pos = int(step.context_lens[lane]) - 1
                    assert step.block_tables[lane, pos // BS] >= 0, "no KV block for a step's position"
            toks = np.full(job.batch, -1, np.int32)
            for lane in range(job.batch):
                if step.lane_valid[lane]:
                    toks[lane] = chained_token(int(step.seed[lane]), int(step.context_lens[lane]),
                                               int(step.lane_tokens(lane)[-1]))
            rows.append(toks)
            step = next_step(step, toks)
        t = np.stack(rows, axis=1)
        return JobResult(job_id=job.job_id, generation=job.generation, kind=job.kind, status=status, tokens=t,
                         logprobs=np.full(t.shape, -0.5, np.float32))


def run(steps: int, ps, events_for=None, mixed: int = 0) -> StepsExecutor:
    """`mixed` > 0: the backend takes mixed batches of up to that many tokens (llamacpp); the scheduler's
    default batch.mixed_batches is on, so every job goes through its mixed path."""
    cfg = SchedulerConfig(decode_steps=steps)
    ex = StepsExecutor(make_scheduler(cfg, block_size=BS, num_blocks=256, piece=piece, mixed=mixed),
                       token_fn=lambda s, p: 0)
    for rid, p in enumerate(ps, start=1):
        ex.submit(rid, p)
    pipelined(ex, events=None if events_for is None else events_for(ex))
    assert kv_fully_free(ex.sched) and not ex.sched.view.requests
    return ex


@pytest.mark.parametrize("steps", [4, 8])
def test_outputs_equal_the_one_step_run(steps: int) -> None:
    ps = workload(random.Random(15), 30)  # a seed whose lanes end (EOS, stops) inside multi-step jobs
    one = run(1, ps)
    many = run(steps, ps)
    assert outcome(many) == outcome(one)
    c = many.sched.counters
    assert c["multi_step_jobs"] > 3 and c["multi_step_tokens_dropped"] > 0  # lanes ended mid-job (EOS, stops)
    assert c["decode_jobs"] < one.sched.counters["decode_jobs"]


def test_a_waiting_prompt_or_a_near_deadline_keeps_jobs_to_one_step() -> None:
    s = make_scheduler(SchedulerConfig(decode_steps=4), block_size=BS)
    ex = StepsExecutor(s, token_fn=lambda a, b: 0)
    ex.submit(1, params(max_tokens=40, seed=1))
    ex.submit(2, params(max_tokens=40, seed=2, deadline_ms=500))
    pipelined(ex)
    assert s.counters.get("multi_step_jobs", 0) == 0  # request 2's deadline is always within the margin
    ex.submit(3, params(max_tokens=40, seed=3))
    pipelined(ex)
    assert s.counters["multi_step_jobs"] > 0


def test_cancels_mid_job_drop_the_rest_of_the_lane() -> None:
    ps = workload(random.Random(13), 16)
    ref = outcome(run(1, ps))

    def events_for(ex):
        def cancel_one(now: float) -> None:
            live = sorted(rid for rid, r in ex.sched.view.requests.items() if r.job_id is not None and not r.terminal)
            if live:
                ex.handle(ex.sched.cancel(live[0], now))
        return {k: cancel_one for k in range(15, 300, 20)}

    got = outcome(run(4, ps, events_for))
    assert set(got) == set(ref)
    for rid, res in got.items():
        assert res[0] == ref[rid][0][:len(res[0])]
        if res[3] != "cancelled":
            assert res == ref[rid]


# ------------------------------------------------------------------ mixed batches (the llamacpp backend)
@pytest.mark.parametrize("steps", [4, 8])
def test_with_mixed_batches_outputs_equal_the_one_step_run(steps: int) -> None:
    ps = workload(random.Random(17), 30)
    one = run(1, ps, mixed=4096)
    many = run(steps, ps, mixed=4096)
    assert outcome(many) == outcome(one)
    c = many.sched.counters
    assert c["multi_step_jobs"] > 3 and c["multi_step_tokens_dropped"] > 0
    assert c["mixed_jobs"] > 0  # the prompts still rode in mixed jobs
    assert c["mixed_jobs"] + c["decode_jobs"] < one.sched.counters["mixed_jobs"]
    assert "decode_jobs" not in one.sched.counters  # the one-step run is all mixed jobs
    for _, job in many.jobs:  # a multi-step job is a decode job of a compiled profile, never with a prompt
        assert (job.kind == JobKind.DECODE) == (job.decode_steps > 1)
        if job.kind == JobKind.DECODE:
            assert job.batch in (1, 4, 8, 16) and all(n == 1 for _, n, _ in lanes_of(job))


def _mixed(steps: int = 4, **cfg) -> tuple[StepsExecutor, float]:
    s = make_scheduler(SchedulerConfig(decode_steps=steps, **cfg), block_size=BS, num_blocks=256, mixed=4096)
    return StepsExecutor(s, token_fn=lambda a, b: 0), 0.0


def _tick(ex: StepsExecutor, now: float) -> list[Job]:
    """One tick; the jobs it submitted (left pending)."""
    before = len(ex.jobs)
    ex.handle(ex.sched.tick(now))
    return [job for _, job in ex.jobs[before:]]


def test_with_mixed_batches_a_stable_batch_multi_steps_and_a_prompt_goes_back_to_mixed_one_step_jobs() -> None:
    ex, now = _mixed()
    seeds = {1: 1, 2: 4, 3: 5, 4: 8}  # none samples EOS within 40 tokens
    for rid in (1, 2, 3):
        ex.submit(rid, params(n_prompt=5, max_tokens=40, seed=seeds[rid]))
    (first,) = _tick(ex, now)  # the three prompts in one mixed job
    assert first.kind == JobKind.PREFILL and [n for _, n, _ in lanes_of(first)] == [5, 5, 5]
    ex.complete_one(now)
    (job,) = _tick(ex, now)  # nothing waits: the three decode lanes as one 4-step decode job of profile 4
    assert (job.kind, job.decode_steps, job.batch) == (JobKind.DECODE, 4, 4)
    assert lanes_of(job) == [(1, 1, 1), (4, 1, 1), (5, 1, 1)]
    ex.submit(4, params(n_prompt=6, max_tokens=40, seed=seeds[4]), now)  # arrives while that job runs
    ex.complete_one(now)
    (job,) = _tick(ex, now)  # a prompt waits: one mixed one-step job of the three lanes and the prompt
    assert (job.kind, job.decode_steps) == (JobKind.PREFILL, 1)
    assert lanes_of(job) == [(1, 1, 1), (4, 1, 1), (5, 1, 1), (8, 6, 1)]
    ex.complete_one(now)
    (job,) = _tick(ex, now)  # stable again: four lanes, four steps
    assert (job.kind, job.decode_steps, job.batch) == (JobKind.DECODE, 4, 4) and len(lanes_of(job)) == 4
    ex.complete_one(now)
    assert [len(ex.tokens[rid]) for rid in (1, 2, 3, 4)] == [10, 10, 10, 5]
    pipelined(ex, now)
    assert kv_fully_free(ex.sched) and [len(ex.tokens[rid]) for rid in (1, 2, 3, 4)] == [40] * 4


def test_with_mixed_batches_steps_stop_at_the_closest_max_tokens_and_near_deadlines_keep_one_step() -> None:
    ex, now = _mixed(steps=8)
    ex.submit(1, params(n_prompt=5, max_tokens=40, seed=1))
    ex.submit(2, params(n_prompt=5, max_tokens=4, seed=2))
    _tick(ex, now)  # both prompts in one mixed job: each samples its first token
    ex.complete_one(now)
    (job,) = _tick(ex, now)
    assert (job.kind, job.decode_steps) == (JobKind.DECODE, 3)  # request 2 has 3 tokens left
    ex.complete_one(now)
    assert len(ex.tokens[2]) == 4 and 2 in ex.terminal and len(ex.tokens[1]) == 4
    (job,) = _tick(ex, now)
    assert (job.kind, job.decode_steps) == (JobKind.DECODE, 8)
    ex.complete_one(now)
    ex.submit(3, params(n_prompt=5, max_tokens=40, seed=5, deadline_ms=500), now)
    (job,) = _tick(ex, now)  # the prompt waits: mixed
    assert (job.kind, job.decode_steps) == (JobKind.PREFILL, 1)
    ex.complete_one(now)
    for _ in range(5):  # request 3's deadline is within the 1 s margin: mixed one-step jobs only
        (job,) = _tick(ex, now)
        assert (job.kind, job.decode_steps) == (JobKind.PREFILL, 1) and len(lanes_of(job)) == 2
        ex.complete_one(now)
        now += 0.001
    ex.handle(ex.sched.cancel(3, now))
    (job,) = _tick(ex, now)
    assert (job.kind, job.decode_steps) == (JobKind.DECODE, 8) and len(lanes_of(job)) == 1
