"""executor.decode_steps: the worker runs n decode steps per job; outputs equal the one-step run (issue 23)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from engine.core.scheduler_config import SchedulerConfig
from ipc.records import Job, JobKind, JobResult, JobStatus
from test_scheduler_queued_step import BS, FollowingExecutor, chained_token, outcome, pipelined, workload
from test_scheduler_fakes import kv_fully_free, make_scheduler, params
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


def run(steps: int, ps, events_for=None) -> StepsExecutor:
    cfg = SchedulerConfig(decode_steps=steps)
    ex = StepsExecutor(make_scheduler(cfg, block_size=BS, num_blocks=256, piece=piece), token_fn=lambda s, p: 0)
    for rid, p in enumerate(ps, start=1):
        ex.submit(rid, p)
    pipelined(ex, events=None if events_for is None else events_for(ex))
    assert kv_fully_free(ex.sched) and not ex.sched._requests
    return ex


@pytest.mark.parametrize("steps", [4, 8])
def test_outputs_equal_the_one_step_run(steps: int) -> None:
    ps = workload(random.Random(11), 30)
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
            live = sorted(rid for rid, r in ex.sched._requests.items() if r.job_id is not None and not r.terminal)
            if live:
                ex.handle(ex.sched.cancel(live[0], now))
        return {k: cancel_one for k in range(15, 300, 20)}

    got = outcome(run(4, ps, events_for))
    assert set(got) == set(ref)
    for rid, res in got.items():
        assert res[0] == ref[rid][0][:len(res[0])]
        if res[3] != "cancelled":
            assert res == ref[rid]
