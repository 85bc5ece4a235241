"""Alternatives and prompt logprobs through the scheduler (fake clock, a fake chip that answers them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.core.actions import EmitTokens
from engine.core.scheduler_config import SchedulerConfig
from ipc.logprob_wants import PROMPT, top_count
from ipc.records import Job, JobKind, JobResult, JobStatus
from test_scheduler_fakes import FakeExecutor, kv_fully_free, make_scheduler, params


def alt(pos: int, j: int) -> tuple[int, float]:
    """The fake chip's j-th alternative at a sampled position: a pure function, so tests can expect it."""
    return 1 + (pos * 13 + j) % 900, -0.25 * (j + 1) - pos / 1000.0


@dataclass
class LogprobExecutor(FakeExecutor):
    """Answers what lanes ask in their want_logprobs byte, as the worker's arrays (ipc.records.JobResult)."""

    emits: list[EmitTokens] = field(default_factory=list)

    def handle(self, actions) -> None:
        self.emits += [a for a in actions if isinstance(a, EmitTokens)]
        super().handle(actions)

    def result_for(self, job: Job, status: JobStatus = JobStatus.OK) -> JobResult:
        res = super().result_for(job, status)
        ks = [top_count(w) if job.lane_valid[i] and job.sample[i] else 0 for i, w in enumerate(job.want_logprobs)]
        if max(ks, default=0):
            k = max(ks)
            res.top_ids = np.full((job.batch, k), -1, np.int32)
            res.top_logprobs = np.zeros((job.batch, k), np.float32)
            for lane, kl in enumerate(ks):
                for j in range(kl):
                    res.top_ids[lane, j], res.top_logprobs[lane, j] = alt(int(job.context_lens[lane]), j)
        asks = [i for i in range(job.batch) if job.lane_valid[i] and job.want_logprobs[i] & PROMPT]
        if asks:
            starts = np.zeros(job.batch + 1, np.int32)
            lps, ids, tl = [], [], []
            kmax = max(top_count(job.want_logprobs[i]) for i in asks)
            for lane in range(job.batch):
                n = len(job.lane_tokens(lane)) - 1 if lane in asks else 0
                starts[lane + 1] = starts[lane] + n
                for p in range(1, n + 1):  # the token at position p given the ones before
                    lps.append(-p / 10.0)
                    ids.append([alt(p, j)[0] for j in range(kmax)])
                    tl.append([alt(p, j)[1] for j in range(kmax)])
            res.prompt_logprobs, res.prompt_start = np.array(lps, np.float32), starts
            if kmax:
                res.prompt_top_ids = np.array(ids, np.int32).reshape(-1, kmax)
                res.prompt_top_logprobs = np.array(tl, np.float32).reshape(-1, kmax)
        return res


def test_alternatives_ride_with_their_tokens_through_held_stop_sequences_and_one_step_jobs():
    def run(stop):
        s = make_scheduler(SchedulerConfig(decode_steps=4))  # lanes asking for alternatives stay one-step
        ex = LogprobExecutor(s)
        ex.submit(1, params(n_prompt=5, max_tokens=6, seed=3, logprobs=True, top_logprobs=3, stop=stop))
        ex.run()
        assert kv_fully_free(s)
        return ex

    free = run([])
    toks = free.tokens[1]
    # a stop sequence that never completes but starts with the third output token: that token is held back
    # a step and must keep its own alternatives, not take the next token's
    ex = run([[toks[2], toks[2]]] if toks[3] != toks[2] else [[toks[2], toks[3] + 1]])
    assert ex.tokens[1] == toks
    got = [(t, lp, top) for a in ex.emits if a.request_id == 1
           for t, lp, top in zip(a.tokens, a.logprobs, a.top_logprobs)]
    assert len(got) == 6
    assert any(len(a.tokens) == 2 for a in ex.emits)  # the held token left with the next one
    for k, (t, lp, top) in enumerate(got):
        pos = 5 + k  # the position the token was sampled at (the lane's context length)
        assert top == [[alt(pos, j)[0], np.float32(alt(pos, j)[1]).item()] for j in range(3)]
        assert lp == -0.5
    for _, job in ex.jobs:
        assert job.decode_steps == 1


def test_prompt_logprobs_are_computed_whole_from_position_0_and_emitted_once_before_the_tokens():
    cfg = SchedulerConfig(prefill_chunk_tokens=16, prefix_cache=True)
    s = make_scheduler(cfg)
    ex = LogprobExecutor(s)
    warm = params(n_prompt=40, max_tokens=2, seed=1)
    ex.submit(1, warm)
    ex.run()
    # the same prompt again: a prefix-cache hit and a chunked prompt, unless prompt logprobs need it whole
    ex.submit(2, params(n_prompt=40, max_tokens=3, seed=1, prompt_logprobs=2))
    ex.run()
    prompt_jobs = [job for _, job in ex.jobs if job.kind == JobKind.PREFILL and any(
        job.lane_valid[i] and job.want_logprobs[i] & PROMPT for i in range(job.batch))]
    assert len(prompt_jobs) == 1
    job = prompt_jobs[0]
    lane = next(i for i in range(job.batch) if job.want_logprobs[i] & PROMPT)
    assert int(job.positions[job.query_start[lane]]) == 0 and len(job.lane_tokens(lane)) == 40
    mine = [a for a in ex.emits if a.request_id == 2]
    assert mine[0].prompt_logprobs is not None and not mine[0].tokens
    assert all(a.prompt_logprobs is None for a in mine[1:])
    pl = mine[0].prompt_logprobs
    assert pl["tokens"] == warm.prompt
    assert pl["logprobs"][0] is None and pl["top_logprobs"][0] == []
    assert pl["logprobs"][1:] == [np.float32(-p / 10.0).item() for p in range(1, 40)]
    assert pl["top_logprobs"][5] == [[alt(5, j)[0], np.float32(alt(5, j)[1]).item()] for j in range(2)]
    assert len(ex.tokens[2]) == 3 and ex.terminal[2].usage["cached_tokens"] == 0
    # the plain request before it did chunk (so the whole-prompt job above is the ask's doing)
    first = [job for _, job in ex.jobs if job.kind == JobKind.PREFILL][0]
    assert len(first.tokens) == 16


def test_max_tokens_0_with_prompt_logprobs_answers_the_prompt_and_no_token():
    s = make_scheduler()
    ex = LogprobExecutor(s)
    ex.submit(1, params(n_prompt=9, max_tokens=0, prompt_logprobs=0))
    ex.run()
    done = ex.terminal[1]
    assert done.finish_reason == "length" and done.usage["completion_tokens"] == 0
    assert ex.tokens[1] == []
    assert len(ex.emits[0].prompt_logprobs["logprobs"]) == 9
    assert kv_fully_free(s)


def test_max_tokens_0_without_prompt_logprobs_and_out_of_range_counts_are_refused():
    s = make_scheduler()
    ex = LogprobExecutor(s)
    ex.submit(1, params(max_tokens=0))
    ex.submit(2, params(top_logprobs=21))
    assert ex.terminal[1].code == 400 and ex.terminal[1].reason == "invalid_max_tokens"
    assert ex.terminal[2].code == 400 and ex.terminal[2].reason == "invalid_logprobs"


def test_a_failed_job_recomputes_the_prompt_and_its_logprobs_go_out_once():
    s = make_scheduler()
    ex = LogprobExecutor(s)
    ex.fail_jobs = {1}  # the whole-prompt job fails on the chip: the request is recomputed
    ex.submit(1, params(n_prompt=12, max_tokens=4, prompt_logprobs=1))
    ex.run()
    prompt_jobs = [job for _, job in ex.jobs
                   if any(job.lane_valid[i] and job.want_logprobs[i] & PROMPT for i in range(job.batch))]
    assert [job.job_id for job in prompt_jobs][:1] == [1] and len(prompt_jobs) == 2
    assert sum(a.prompt_logprobs is not None for a in ex.emits) == 1
    assert len(ex.tokens[1]) == 4 and ex.terminal[1].finish_reason == "length"
