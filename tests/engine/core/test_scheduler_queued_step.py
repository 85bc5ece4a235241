"""executor.queue_next_step: a decode lane's step N+1 submitted while step N runs.

The fake worker here resolves QUEUED_STEP_TOKEN tokens with the worker's own
`QueuedStepTokens` and makes each token depend on the lane's input token too, so
a queued step fed the wrong token would change the output. Every run is
compared with the same requests run synchronously (one job, no queued step).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from engine.core.actions import FailRequest, FinishRequest
from engine.core.scheduler_config import SchedulerConfig
from ipc.records import QUEUED_STEP_TOKEN, Job, JobKind, JobResult, JobStatus
from test_scheduler_fakes import EOS, VOCAB, FakeExecutor, decode_turn_gaps, kv_fully_free, make_scheduler, params
from test_scheduler_text import piece
from workers.queued_step_tokens import QueuedStepTokens, UnresolvedQueuedStep

BS = 16


def chained_token(seed: int, pos: int, prev: int) -> int:
    """Depends on the input token; EOS now and then (about 1 in 40), text bytes mostly."""
    h = (seed * 1_000_003 + pos * 7_919 + prev * 104_729) % 4001
    return EOS if h % 40 == 7 else 1 + h % (VOCAB - 1)


@dataclass
class FollowingExecutor(FakeExecutor):
    queued_step_tokens: QueuedStepTokens = field(default_factory=lambda: QueuedStepTokens(BS))
    invalid: set[int] = field(default_factory=set)  # jobs the worker refused (an unresolvable queued-step token)

    def result_for(self, job: Job, status: JobStatus = JobStatus.OK) -> JobResult:
        if status == JobStatus.OK:
            try:
                self.queued_step_tokens.resolve(job)
            except UnresolvedQueuedStep:
                self.invalid.add(job.job_id)
                return JobResult.failed(job, JobStatus.INVALID)
        else:
            return JobResult.failed(job, status)
        toks = np.full(job.batch, -1, np.int32)
        for lane in range(job.batch):
            if job.lane_valid[lane] and job.sample[lane]:
                prev = int(job.lane_tokens(lane)[-1])
                assert prev != QUEUED_STEP_TOKEN
                toks[lane] = chained_token(int(job.seed[lane]), int(job.context_lens[lane]), prev)
        self.queued_step_tokens.record(job, toks)
        return JobResult(job_id=job.job_id, generation=job.generation, kind=job.kind, status=status,
                         tokens=toks, logprobs=np.full(job.batch, -0.5, np.float32))


def pipelined(ex: FakeExecutor, now: float = 0.0, dt: float = 0.001, events=None, max_steps: int = 200_000,
              held: list | None = None) -> float:
    """tick, then answer only the oldest job: the chip keeps what was queued behind it (a real chip's order).
    `events`: {step: callable(now)} run after that step's tick, while a step and the one queued behind it
    are in flight (cancels landing mid-step). `held` gets, after every tick, what the chip holds:
    (a decode job was answered before, jobs in flight, queued steps among them)."""
    decoded = False
    for step in range(max_steps):
        if not ex.sched.has_work():
            return now
        ex.handle(ex.sched.tick(now))
        if held is not None:  # a queued step's input is the token its predecessor has not yet sampled
            held.append((decoded, len(ex.pending),
                         sum(bool((job.tokens == QUEUED_STEP_TOKEN).any()) for _, job in ex.pending)))
        if events and step in events:
            events[step](now)
        if ex.pending:
            decoded = decoded or ex.pending[0][1].kind == JobKind.DECODE
            ex.complete_one(now, 0)
        now += dt
    raise AssertionError("scheduler did not become idle")


def workload(rng: random.Random, n: int) -> list:
    ps = []
    for i in range(n):
        kw = {}
        if i % 5 == 1:
            kw["stop_token_ids"] = [int(rng.randrange(1, VOCAB))]
        if i % 7 == 2:
            kw["stop_strings"] = [bytes([rng.randrange(97, 100)]).decode()]
        ps.append(params(n_prompt=rng.randrange(3, 40), max_tokens=rng.randrange(1, 30), seed=i, **kw))
    return ps


def run_all(queue: bool, ps, *, max_inflight: int = 1, events_for=None, fail_jobs=(), held: list | None = None
            ) -> FollowingExecutor:
    cfg = SchedulerConfig(queue_next_step=queue, max_inflight=max_inflight)
    ex = FollowingExecutor(make_scheduler(cfg, block_size=BS, num_blocks=256, piece=piece),
                           token_fn=lambda s, p: 0, fail_jobs=set(fail_jobs))
    for rid, p in enumerate(ps, start=1):
        ex.submit(rid, p)
    pipelined(ex, events=None if events_for is None else events_for(ex), held=held)
    if fail_jobs:  # failed jobs' blocks stay quarantined until the chip recovers
        ex.sched.chips[0].kv.check_invariants()
        ex.handle(ex.sched.on_chip_up(0, 99.0))
    assert kv_fully_free(ex.sched)
    assert not ex.sched.view.requests
    return ex


def outcome(ex: FakeExecutor) -> dict:
    return {rid: (ex.tokens.get(rid, []), "".join(ex.texts.get(rid, [])), type(t).__name__,
                  getattr(t, "finish_reason", None) or getattr(t, "reason", None))
            for rid, t in ex.terminal.items()}


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_outputs_equal_the_synchronous_run(max_inflight: int) -> None:
    ps = workload(random.Random(3), 40)
    sync = run_all(False, ps)
    held: list[tuple[bool, int, int]] = []
    queued = run_all(True, ps, max_inflight=max_inflight, held=held)
    assert outcome(queued) == outcome(sync)
    c = queued.sched.counters
    assert c["queued_steps"] > 50  # the path ran
    assert c["queued_steps_past_end"] > 0  # lanes that ended (EOS, stop) with a step queued behind them
    assert "queued_steps" not in sync.sched.counters
    # on every tick the chip held at most one job past the limit: the queued step
    assert max(n for _, n, _ in held) <= max_inflight + 1
    # and once decoding, it mostly held that one: a step queued behind the running one, so the chip did not
    # wait for the scheduler's turn (the other ticks run a prompt's job, or the last steps)
    after = [(n, q) for decoded, n, q in held if decoded]
    queued_behind = sum(1 for n, q in after if n == max_inflight + 1 and q > 0)
    assert queued_behind > len(after) // 2, (queued_behind, len(after))


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_a_ready_lane_takes_its_turn_beside_the_lanes_with_queued_steps(max_inflight: int) -> None:
    """9 lanes for a B8: the lanes with a step queued step after step once sorted first and kept the ninth at its
    first token until they finished (it had 1 token, the others 86-100); now it takes turns with them."""
    cfg = SchedulerConfig(queue_next_step=True, max_inflight=max_inflight)
    ex = FollowingExecutor(make_scheduler(cfg, block_size=BS, num_blocks=256), token_fn=lambda s, p: 0)
    for rid in range(1, 10):
        ex.submit(rid, params(n_prompt=8, max_tokens=100, seed=rid, ignore_eos=True))
    now = 0.0
    while not ex.terminal:  # tick, then answer the oldest job (as in `pipelined`), up to the first finish
        ex.handle(ex.sched.tick(now))
        if ex.pending:
            ex.complete_one(now, 0)
        now += 0.001
    got = [len(ex.tokens.get(rid, [])) for rid in range(1, 10)]
    assert min(got) >= max(got) // 2, got
    assert max(decode_turn_gaps(ex.jobs).values()) <= 3  # no lane sat out more than two decode jobs running
    decode_lanes = sum(int(j.lane_valid.sum()) for _, j in ex.jobs if j.kind == JobKind.DECODE)
    assert ex.sched.counters["queued_steps"] >= 0.75 * decode_lanes  # and the chip still queues steps behind its lanes


def test_cancels_and_deadlines_mid_step_end_cleanly() -> None:
    ps = workload(random.Random(5), 24)
    ps = [p if i % 4 else type(p)(**{**p.__dict__, "deadline_ms": 7 + i}) for i, p in enumerate(ps)]
    ref = outcome(run_all(False, [type(p)(**{**p.__dict__, "deadline_ms": None}) for p in ps]))

    def events_for(ex):
        def cancel_one(now: float) -> None:  # a lane with its step running and the next one queued
            live = sorted(rid for rid, r in ex.sched.view.requests.items() if r.next_job is not None and not r.terminal)
            if live:
                ex.handle(ex.sched.cancel(live[0], now))
        return {k: cancel_one for k in range(20, 400, 25)}

    got = run_all(True, ps, events_for=events_for)
    res = outcome(got)
    assert set(res) == set(ref)  # one terminal event each
    ended = 0
    for rid, (toks, text, kind, reason) in res.items():
        full = ref[rid][0]
        assert toks == full[:len(toks)], rid  # nothing past the end, nothing made up
        if reason in ("cancelled", "deadline_exceeded"):
            ended += 1
        else:
            assert res[rid] == ref[rid]
    assert ended >= 6
    c = got.sched.counters
    assert c["queued_steps"] > 0 and c["queued_steps_discarded"] > 0  # cancelled with a step queued behind


def test_a_failed_step_with_one_queued_behind_it_requeues_each_lane_once() -> None:
    ps = workload(random.Random(7), 8)
    sync = outcome(run_all(False, ps))
    ex = run_all(True, ps, fail_jobs=set(range(10, 200, 17)))
    assert ex.invalid  # the queued steps behind the failed jobs could not be resolved
    assert ex.sched.counters["requeued"] + ex.sched.counters["failed_job_failed"] >= 1
    got = outcome(ex)
    assert set(got) == set(sync)
    for rid, res in got.items():  # requeued before any token (then equal), or 500 after some (a prefix)
        if res[2] == "FinishRequest":
            assert res == sync[rid]
        else:
            assert res[3] in ("job_failed", "job_invalid") and res[0] == sync[rid][0][:len(res[0])]


def test_worker_killed_with_two_jobs_and_a_queued_step_in_flight() -> None:
    ps = workload(random.Random(9), 12)
    cfg = SchedulerConfig(queue_next_step=True, max_inflight=2)
    ex = FollowingExecutor(make_scheduler(cfg, block_size=BS, num_blocks=256, piece=piece), token_fn=lambda s, p: 0)
    for rid, p in enumerate(ps, start=1):
        ex.submit(rid, p)
    now = 0.0
    def queued() -> int:
        return sum(1 for r in ex.sched.view.requests.values() if r.next_job is not None)

    for _ in range(200):  # until the chip holds two jobs and a queued step (not a prompt's job in its place)
        ex.handle(ex.sched.tick(now))
        ch = ex.sched.chips[0]
        if len(ch.inflight) == 3 and queued():
            break
        ex.complete_one(now, 0)
        now += 0.001
    assert len(ex.sched.chips[0].inflight) == 3 and queued() > 0
    # the stats gauge an operator (and the chaos scenario worker-kill-inflight) reads: lanes with a queued step
    assert ex.sched.stats()["chips"]["0"]["queued_steps_inflight"] == queued()
    ex.pending.clear()
    ex.queued_step_tokens = QueuedStepTokens(BS)  # the new worker remembers nothing
    ex.handle(ex.sched.on_chip_down(0, now))
    assert ex.sched.stats()["chips"]["0"]["queued_steps_inflight"] == 0  # the lanes went with the chip
    ex.handle(ex.sched.on_chip_up(0, now))
    pipelined(ex, now)
    assert kv_fully_free(ex.sched) and not ex.sched.view.requests
    assert set(ex.terminal) == set(range(1, len(ps) + 1))  # exactly one terminal each (FakeExecutor checks)
    for t in ex.terminal.values():
        assert isinstance(t, FinishRequest) or (isinstance(t, FailRequest) and t.reason == "worker_died")


def test_job_timeout_of_the_running_step_drops_the_queued_one() -> None:
    cfg = SchedulerConfig(queue_next_step=True, job_timeout_s=0.5)
    ex = FollowingExecutor(make_scheduler(cfg, block_size=BS, num_blocks=64), token_fn=lambda s, p: 0)
    ex.submit(1, params(n_prompt=4, max_tokens=20, seed=1))
    now = 0.0
    for _ in range(6):
        ex.handle(ex.sched.tick(now))
        ex.complete_one(now, 0)
        now += 0.001
    ex.handle(ex.sched.tick(now))
    assert len(ex.sched.chips[0].inflight) == 2
    ex.pending.clear()  # neither answers
    ex.handle(ex.sched.tick(now + 1.0))  # both time out
    assert isinstance(ex.terminal[1], FailRequest) and ex.terminal[1].reason == "job_timeout"
    ex.handle(ex.sched.on_chip_up(0, now + 1.0))
    assert kv_fully_free(ex.sched) and not ex.sched.view.requests
