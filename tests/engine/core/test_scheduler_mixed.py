"""Mixed batches: one job carries the ready decode lanes and prompt chunks, within a token budget."""

from __future__ import annotations

import random

import pytest

from engine.core.scheduler_config import SchedulerConfig
from ipc.records import JobKind
from test_scheduler_fakes import FakeExecutor, default_token, kv_fully_free, make_scheduler, params


def lanes_of(job) -> list[tuple[int, int, int]]:
    """(seed, new tokens, sample) per valid lane."""
    qs = job.query_start
    return [(int(job.seed[k]), int(qs[k + 1] - qs[k]), int(job.sample[k])) for k in range(job.batch)
            if job.lane_valid[k]]


def by_turn(s) -> list[int]:
    """The ready decode lanes in the order a job takes them (earliest deadline, then the lane whose last
    step is oldest: `BatchPlanner.decode_candidates`); seeds equal request ids here."""
    return [r.request_id for r in sorted((s.view.requests[rid] for rid in s.chips[0].decode_ready),
                                         key=lambda r: r.decode_key)]


def expected_tokens(p) -> list[int]:
    n = len(p.prompt)
    return [default_token(p.seed, n + i) for i in range(p.max_tokens)]


def generating(n: int, budget_cfg: int = 0, mixed: int = 4096, **cfg):
    """A mixed-batch scheduler with n streams decoding (past their first decode step: the mixed budget
    bounds their steps, test_scheduler_burst.py), waiting for their next one."""
    s = make_scheduler(SchedulerConfig(mixed_token_budget=budget_cfg, **cfg), mixed=mixed)
    ex = FakeExecutor(s)
    for i in range(n):
        ex.submit(i, params(n_prompt=8, max_tokens=20, seed=i))
    now = 0.0
    for _ in range(1000):  # each job takes at most the largest profile's count of prompts
        if len(s.chips[0].decode_ready) >= n and all(s.view.requests[i].generated > 1 for i in range(n)):
            break
        ex.step(now)
        now += 0.001
    else:
        pytest.fail(f"{len(s.chips[0].decode_ready)} of {n} sequences ready for decode after 1000 steps")
    return s, ex


def test_a_mixed_job_carries_every_ready_decode_lane_and_the_new_prompts():
    s, ex = generating(4)
    ex.submit(10, params(n_prompt=30, max_tokens=5, seed=10))
    ex.submit(11, params(n_prompt=12, max_tokens=5, seed=11))
    ex.handle(s.tick(0.01))
    (_, job), = ex.pending
    assert job.kind == JobKind.PREFILL
    assert lanes_of(job) == [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1), (10, 30, 1), (11, 12, 1)]
    c = s.stats()["counters"]
    # the first carried 4 prompts only, the second the 4 lanes alone
    assert c["mixed_jobs"] == 3 and c["mixed_jobs_decode_and_prefill"] == 1
    assert c["prefill_jobs"] == 2 and c["prefill_lanes"] == 6


def test_the_token_budget_chunks_a_prompt_and_its_next_chunk_goes_first():
    s, ex = generating(2, budget_cfg=20)
    ex.submit(10, params(n_prompt=40, max_tokens=3, seed=10))
    ex.submit(11, params(n_prompt=5, max_tokens=3, seed=11))
    seen = []
    now = 0.01
    for _ in range(1000):  # 45 prompt tokens at 18 a job, then 3 tokens each: a few dozen jobs at most
        if 10 in ex.terminal and 11 in ex.terminal:
            break
        ex.handle(s.tick(now))
        for _, job in ex.pending:
            assert len(job.tokens) <= 20
            seen.append(lanes_of(job))
        ex.complete_all(now)
        now += 0.01
    else:
        pytest.fail(f"requests 10 and 11 not both finished after 1000 jobs: terminal {sorted(ex.terminal)}")
    # job 1: two decode lanes + 18 of 40; job 2: the next 18 first, the short prompt gets nothing
    # (budget spent); job 3: the last 4, then the short prompt
    assert seen[0] == [(0, 1, 1), (1, 1, 1), (10, 18, 0)]
    assert seen[1] == [(0, 1, 1), (1, 1, 1), (10, 18, 0)]
    assert seen[2] == [(0, 1, 1), (1, 1, 1), (10, 4, 1), (11, 5, 1)]
    ex.run(now)
    for rid, p in ((10, params(n_prompt=40, max_tokens=3, seed=10)), (11, params(n_prompt=5, max_tokens=3, seed=11))):
        assert ex.tokens[rid] == expected_tokens(p)
    assert kv_fully_free(s)


def test_the_budget_is_the_smaller_of_the_configured_one_and_the_backends():
    s, ex = generating(0, budget_cfg=100, mixed=16)
    ex.submit(10, params(n_prompt=40, max_tokens=1, seed=10))
    ex.handle(s.tick(0.01))
    (_, job), = ex.pending
    assert lanes_of(job) == [(10, 16, 0)]


def test_a_zero_budget_is_the_backends_limit():
    s = make_scheduler(SchedulerConfig(prefill_chunk_tokens=4096, mixed_token_budget=0), mixed=3000, max_seq=4096)
    ex = FakeExecutor(s)
    ex.submit(10, params(n_prompt=4000, max_tokens=1, seed=10))
    ex.handle(s.tick(0.0))
    (_, job), = ex.pending
    assert lanes_of(job) == [(10, 3000, 0)]


def test_by_default_long_prompts_arriving_ride_in_512_token_jobs_and_every_stream_steps_in_each():
    """Scenario long-prompt (docs/benchmarks.md): the default budget is llama.cpp's n_ubatch, not the
    backend's limit (max_seq), so two long prompts never hold the running streams for more than one
    512-token job; with the backend's limit they rode 1,024 prompt tokens a job."""
    s = make_scheduler(SchedulerConfig(), mixed=4096, max_seq=4096)
    assert s.planner.mixed_budget == 512
    ex = FakeExecutor(s)
    for i in range(6):
        ex.submit(i, params(n_prompt=8, max_tokens=200, seed=i))
    for step in range(10):
        ex.step(step * 0.001)
    assert len(s.chips[0].decode_ready) == 6
    ex.submit(10, params(n_prompt=1500, max_tokens=2, seed=10))
    ex.submit(11, params(n_prompt=1500, max_tokens=2, seed=11))
    now, jobs = 0.01, []
    while 10 not in ex.terminal or 11 not in ex.terminal:
        ex.handle(s.tick(now))
        jobs += [lanes_of(job) for _, job in ex.pending]
        ex.complete_all(now)
        now += 0.01
        assert len(jobs) < 100
    prefilling = [j for j in jobs if any(n > 1 for _, n, _ in j)]
    assert len(prefilling) >= 6  # 3,000 prompt tokens at < 512 a job
    for j in prefilling:
        assert sum(n for _, n, _ in j) <= 512
        assert {seed for seed, n, _ in j if n == 1} >= {0, 1, 2, 3, 4, 5}  # every stream stepped


def test_a_short_prompt_is_not_split_to_fill_the_budget_a_long_one_is():
    s, ex = generating(2, budget_cfg=40, prefill_chunk_tokens=16)
    ex.submit(10, params(n_prompt=30, max_tokens=2, seed=10))  # long (> 16): chunked
    ex.submit(11, params(n_prompt=12, max_tokens=2, seed=11))  # short: whole or not at all
    ex.submit(12, params(n_prompt=14, max_tokens=2, seed=12))
    ex.handle(s.tick(0.01))
    (_, job), = ex.pending
    # 2 decode + 16 of the long one + the 12-token prompt = 30; the 14-token one does not fit the 10 left
    assert lanes_of(job) == [(0, 1, 1), (1, 1, 1), (10, 16, 0), (11, 12, 1)]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_for_the_next_job():
    s, ex = generating(2, budget_cfg=20, chunked_prefill=False)
    ex.submit(10, params(n_prompt=10, max_tokens=2, seed=10))
    ex.submit(11, params(n_prompt=12, max_tokens=2, seed=11))
    ex.submit(12, params(n_prompt=3, max_tokens=2, seed=12))
    ex.handle(s.tick(0.01))
    (_, job), = ex.pending
    # 2 decode + 10 = 12; the 12-token prompt does not fit the 8 left and is not chunked, and the one
    # behind it waits too (first come, first served within the class)
    assert lanes_of(job) == [(0, 1, 1), (1, 1, 1), (10, 10, 1)]
    ex.complete_all(0.01)
    ex.handle(s.tick(0.02))
    (_, job), = ex.pending
    # 10 first: its turn, drawn at admission, is older than the steps 0 and 1 have had since
    assert lanes_of(job) == [(10, 1, 1), (0, 1, 1), (1, 1, 1), (11, 12, 1), (12, 3, 1)]


def test_a_prompt_larger_than_the_budget_left_still_runs_alone_without_chunking():
    s, ex = generating(0, budget_cfg=20, chunked_prefill=False)
    ex.submit(10, params(n_prompt=30, max_tokens=2, seed=10))
    ex.handle(s.tick(0.01))
    (_, job), = ex.pending
    assert lanes_of(job) == [(10, 30, 1)]


@pytest.mark.parametrize("mixed, enabled", [(0, True), (4096, False)])
def test_separate_jobs_when_the_backend_does_not_declare_mixed_batches_or_they_are_off(mixed, enabled):
    s = make_scheduler(SchedulerConfig(mixed_batches=enabled), mixed=mixed)
    ex = FakeExecutor(s)
    for i in range(3):
        ex.submit(i, params(max_tokens=3, seed=i))
    ex.step(0.0)
    ex.submit(10, params(max_tokens=3, seed=10))
    ex.handle(s.tick(0.01))
    kinds = [j.kind for _, j in ex.pending]
    assert JobKind.DECODE in kinds and all(j.batch == 1 for _, j in ex.pending if j.kind == JobKind.PREFILL)
    assert "mixed_jobs" not in s.stats()["counters"]


def test_decode_lanes_are_capped_at_the_largest_profile_and_prompts_join_them():
    s, ex = generating(20, profiles=(1, 4, 8))
    ex.submit(50, params(n_prompt=6, max_tokens=2, seed=50))
    turns = by_turn(s)
    ex.handle(s.tick(0.01))
    (_, job), = ex.pending
    lanes = lanes_of(job)
    assert [x for x in lanes if x[1] == 1] == [(i, 1, 1) for i in turns[:8]]  # the 8 whose turn it is
    assert lanes[-1] == (50, 6, 1)


@pytest.mark.parametrize("seed", range(5))
def test_random_arrivals_budgets_and_completion_order_give_every_request_its_tokens(seed):
    rng = random.Random(seed)
    s = make_scheduler(SchedulerConfig(mixed_token_budget=rng.choice([8, 24, 64]), max_inflight=rng.choice([1, 2]),
                                       prefill_chunk_tokens=rng.choice([4, 16, 512])),
                       mixed=64, num_blocks=64, block_size=4)  # a small pool: preemption happens
    ex = FakeExecutor(s, rng=rng)
    ps = {}
    now = 0.0
    for rid in range(40):
        ps[rid] = params(n_prompt=rng.randint(1, 50), max_tokens=rng.randint(1, 12), seed=rid)
        ex.submit(rid, ps[rid], now)
        ex.handle(s.tick(now))
        if ex.pending:
            ex.complete_one(now, rng.randrange(len(ex.pending)))
        now += 0.01
    ex.run(now)
    assert {r for r, t in ex.terminal.items() if t.finish_reason == "length"} == set(ps)
    for r, p in ps.items():
        assert ex.tokens[r] == expected_tokens(p), r
    assert kv_fully_free(s)
    assert s.stats()["counters"]["preemptions"] > 0


def test_an_unchunked_prompt_beyond_the_budget_left_runs_and_decode_lanes_yield_to_the_backends_limit():
    s, ex = generating(6, mixed=40, chunked_prefill=False)
    ex.submit(10, params(n_prompt=37, max_tokens=1, seed=10))
    turns = by_turn(s)
    ex.handle(s.tick(0.01))
    (_, job), = ex.pending
    # 6 decode lanes leave 34 of the backend's 40: the prompt still runs, beside only 3 of them
    assert lanes_of(job) == [(i, 1, 1) for i in turns[:3]] + [(10, 37, 1)]
    ex.complete_all(0.01)
    ex.handle(s.tick(0.02))
    (_, job), = ex.pending
    assert sorted(x[0] for x in lanes_of(job)) == [0, 1, 2, 3, 4, 5]  # the three left out go next


def test_waiting_prompts_get_at_least_half_of_a_job_full_of_decode_lanes():
    s, ex = generating(16, budget_cfg=16)
    ex.submit(50, params(n_prompt=20, max_tokens=1, seed=50))
    turns = by_turn(s)
    ex.handle(s.tick(0.01))
    (_, job), = ex.pending
    assert lanes_of(job) == [(i, 1, 1) for i in turns[:8]] + [(50, 8, 0)]


# ---- the prefill window: a burst of arrivals shares one job ----------------------------------------

def test_a_burst_of_prompts_is_held_for_the_prefill_window_and_shares_one_job():
    s = make_scheduler(SchedulerConfig(prefill_window_s=0.002), mixed=4096)
    ex = FakeExecutor(s)
    ex.submit(0, params(n_prompt=30, seed=0), now=0.0)
    ex.handle(s.tick(0.0))
    assert ex.pending == [] and s.next_wakeup(0.0) == pytest.approx(0.002)  # held, with a wake-up to end it
    for rid in (1, 2):
        ex.submit(rid, params(n_prompt=20, seed=rid), now=0.001)
    ex.handle(s.tick(0.001))
    assert ex.pending == [] and s.next_wakeup(0.001) == pytest.approx(0.003)  # until the arrivals pause
    ex.handle(s.tick(0.002))
    assert ex.pending == []
    ex.handle(s.tick(0.003))
    (_, job), = ex.pending
    assert lanes_of(job) == [(0, 30, 1), (1, 20, 1), (2, 20, 1)]
    ex.run(0.004)
    assert kv_fully_free(s)


def test_arrivals_that_never_pause_hold_a_job_at_most_the_window_cap():
    from engine.core.batch_planner import PREFILL_WINDOW_CAP

    s = make_scheduler(SchedulerConfig(prefill_window_s=0.002), mixed=4096, profiles=(1, 4, 8, 16, 32))
    ex = FakeExecutor(s)
    now, rid = 0.0, 0
    for _ in range(1000):  # the cap fires the job after about 11 arrivals
        if ex.pending:
            break
        ex.submit(rid, params(n_prompt=8, seed=rid), now=now)
        ex.handle(s.tick(now))
        now, rid = round(now + 0.0015, 6), rid + 1  # every 1.5 ms: closer than the window
    else:
        pytest.fail("no job left after 1000 arrivals: the prefill window held it past its cap")
    assert now - 0.0015 == pytest.approx(PREFILL_WINDOW_CAP * 0.002, abs=0.0015)
    assert len(lanes_of(ex.pending[0][1])) == rid


def test_the_prefill_window_ends_once_the_waiting_prompts_fill_a_job():
    s = make_scheduler(SchedulerConfig(prefill_window_s=0.002), mixed=64)
    ex = FakeExecutor(s)
    ex.submit(0, params(n_prompt=40, seed=0))
    ex.handle(s.tick(0.0))
    assert ex.pending == []
    ex.submit(1, params(n_prompt=30, seed=1), now=0.0005)
    ex.handle(s.tick(0.0005))  # 70 prompt tokens wait: more than a 64-token job takes
    (_, job), = ex.pending
    assert lanes_of(job)[0] == (0, 40, 1)
    # as many prompts as the largest profile has lanes fill a job too
    s = make_scheduler(SchedulerConfig(prefill_window_s=0.002), mixed=4096, profiles=(1, 2))
    ex = FakeExecutor(s)
    ex.submit(0, params(n_prompt=8, seed=0))
    ex.submit(1, params(n_prompt=8, seed=1))
    ex.handle(s.tick(0.0))
    (_, job), = ex.pending
    assert [lane[0] for lane in lanes_of(job)] == [0, 1]


def test_the_prefill_window_does_not_hold_a_job_with_decode_lanes():
    s, ex = generating(2, prefill_window_s=0.002)
    ex.submit(10, params(n_prompt=12, seed=10), now=0.5)
    ex.handle(s.tick(0.5))
    (_, job), = ex.pending  # the streams already generating do not wait; the prompt rides with them
    assert lanes_of(job) == [(0, 1, 1), (1, 1, 1), (10, 12, 1)]


def test_the_prefill_window_never_holds_a_prompt_into_its_deadline():
    s = make_scheduler(SchedulerConfig(prefill_window_s=0.002), mixed=4096)
    ex = FakeExecutor(s)
    ex.submit(0, params(n_prompt=8, seed=0, deadline_ms=3))
    ex.handle(s.tick(0.0))
    assert ex.pending == [] and s.next_wakeup(0.0) == pytest.approx(0.001)  # a window ahead of the deadline
    ex.handle(s.tick(0.001))
    assert len(ex.pending) == 1


def test_without_mixed_batches_there_is_no_prefill_window():
    s = make_scheduler(SchedulerConfig(prefill_window_s=0.002, mixed_batches=False), mixed=4096)
    ex = FakeExecutor(s)
    ex.submit(0, params(n_prompt=8, seed=0))
    ex.handle(s.tick(0.0))
    assert len(ex.pending) == 1
