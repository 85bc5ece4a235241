"""The prompt-token cap of a mixed job while decode lanes run (`batch.prompt_tokens_while_decoding`).

Streams are seeds 0..STREAMS-1 (one token a job); prompts arriving later have seeds from 10 on, so a lane
is told apart by its seed, never by how many tokens it carries. Fake time only.
"""

from __future__ import annotations

import random

import pytest

from engine.core.scheduler_config import SchedulerConfig, scheduler_config_from
from test_scheduler_fakes import FakeExecutor, default_token, kv_fully_free, make_scheduler, params

STREAMS = 6


PROMPT_LEN: dict[int, int] = {}  # seed -> prompt length, for every request submitted with `submit`


def submit(ex, rid: int, n_prompt: int, max_tokens: int, now: float) -> None:
    PROMPT_LEN[rid] = n_prompt
    ex.submit(rid, params(n_prompt=n_prompt, max_tokens=max_tokens, seed=rid), now)


def lanes_of(job) -> list[tuple[int, int, bool]]:
    """(seed, new tokens, whether they are prompt tokens) per valid lane; a request that finished its
    prompt decodes like the streams."""
    qs = job.query_start
    out = []
    for k in range(job.batch):
        if job.lane_valid[k]:
            n = int(qs[k + 1] - qs[k])
            seed = int(job.seed[k])
            out.append((seed, n, int(job.context_lens[k]) - n < PROMPT_LEN[seed]))
    return out


def decoding(n: int = STREAMS, *, mixed: int = 4096, max_inflight: int = 1, **cfg):
    """A mixed-batch scheduler with n streams decoding (past their first decode step: long answers), ready for
    their next step; a burst's streams before that are not capped (`batch.burst_token_budget`)."""
    s = make_scheduler(SchedulerConfig(max_inflight=max_inflight, **cfg), mixed=mixed, max_seq=4096)
    ex = FakeExecutor(s)
    for i in range(n):
        submit(ex, i, 8, 400, 0.0)
    now = 0.0
    for _ in range(100):
        if len(s.chips[0].decode_ready) == n and all(s.view.requests[i].generated > 1 for i in range(n)):
            return s, ex, now
        ex.step(now)
        now += 0.001
    pytest.fail(f"{len(s.chips[0].decode_ready)} of {n} streams ready after 100 steps")


def drive(s, ex, now: float, until: set[int], max_jobs: int = 500) -> list[list[tuple[int, int]]]:
    """Tick and answer every job (FIFO) until the requests `until` are terminal; the jobs' lanes in order."""
    jobs = []
    while not until <= set(ex.terminal):
        ex.handle(s.tick(now))
        jobs += [lanes_of(job) for _, job in ex.pending]
        ex.complete_all(now)
        now += 0.001
        assert len(jobs) < max_jobs, f"{sorted(until - set(ex.terminal))} not done after {max_jobs} jobs"
    return jobs


def prompt_tokens(lanes) -> int:
    return sum(n for _, n, prompt in lanes if prompt)


def chunks(jobs, rid: int) -> list[int]:
    return [n for j in jobs for seed, n, prompt in j if seed == rid and prompt]


def streams_in(lanes) -> set[int]:
    return {seed for seed, _, prompt in lanes if seed < 10 and not prompt}


def test_a_long_prompt_arriving_while_streams_decode_goes_in_chunks_of_the_cap_one_every_job():
    s, ex, now = decoding(prompt_tokens_while_decoding=64, mixed_token_budget=512)
    submit(ex, 10, 300, 2, now)
    jobs = drive(s, ex, now, {10})
    prefilling = [j for j in jobs if prompt_tokens(j)]
    # 300 tokens in chunks of at most 64, one in each job from the first to the last: 5 jobs in a row
    assert chunks(jobs, 10) == [64, 64, 64, 64, 44]
    first = jobs.index(prefilling[0])
    assert jobs[first:first + 5] == prefilling
    for j in prefilling:
        assert streams_in(j) == set(range(STREAMS))  # every stream stepped in each
    assert ex.tokens[10] == [default_token(10, 300 + i) for i in range(2)]


def test_by_default_two_long_prompts_ride_at_most_256_prompt_tokens_a_job_one_after_the_other():
    """Scenario long-prompt (docs/benchmarks.md): six streams, two 1,500-token prompts. The first prompt's
    chunks go first (its next chunk heads its class), so it is not held back by the second."""
    s, ex, now = decoding()
    assert s.planner.mixed_budget == 512 and s.planner.prompt_cap == 256
    submit(ex, 10, 1500, 2, now)
    submit(ex, 11, 1500, 2, now)
    jobs = drive(s, ex, now, {10, 11})
    prefilling = [j for j in jobs if prompt_tokens(j)]
    assert sum(map(prompt_tokens, prefilling)) == 3000
    assert [prompt_tokens(j) for j in prefilling] == [256] * (3000 // 256) + [3000 % 256]
    for j in prefilling:
        assert streams_in(j) == set(range(STREAMS))
    with_10 = [i for i, j in enumerate(prefilling) if any(seed == 10 and p for seed, _, p in j)]
    with_11 = [i for i, j in enumerate(prefilling) if any(seed == 11 and p for seed, _, p in j)]
    assert with_10 == list(range(1500 // 256 + 1))  # 10's prompt in the first ceil(1500 / 256) jobs
    assert with_11[0] == with_10[-1]  # 11 starts in the job that finishes 10's prompt, not before


@pytest.mark.parametrize("seed", range(4))
def test_every_job_with_decode_lanes_carries_at_most_the_cap_and_every_prompt_finishes(seed):
    """Prompts of every size, some above the cap but below prefill_chunk_tokens (split only by the cap),
    arriving while streams decode: no job with a decode lane carries more than the cap of prompt tokens,
    and every request gets all its tokens (nothing waits forever for a job with more room)."""
    rng = random.Random(seed)
    cap = rng.choice([16, 40, 64])
    s, ex, now = decoding(prompt_tokens_while_decoding=cap, mixed_token_budget=rng.choice([128, 512]),
                          prefill_chunk_tokens=rng.choice([24, 512]))
    want = {}
    jobs = []
    for rid in range(10, 30):
        n, m = rng.choice([3, rng.randint(1, 200), rng.randint(200, 700)]), rng.randint(1, 4)
        want[rid] = [default_token(rid, n + i) for i in range(m)]
        submit(ex, rid, n, m, now)
        ex.handle(s.tick(now))
        jobs += [lanes_of(job) for _, job in ex.pending]
        ex.complete_all(now)
        now += 0.001
    jobs += drive(s, ex, now, set(want))
    with_lanes = [j for j in jobs if any(not p for _, _, p in j)]
    assert max(prompt_tokens(j) for j in with_lanes) == cap  # never more, and reached (the check bites)
    for rid, tokens in want.items():
        assert ex.tokens[rid] == tokens, rid


def test_a_prompt_above_the_cap_but_shorter_than_a_prefill_chunk_is_split_when_it_leads_a_job():
    s, ex, now = decoding(2, prompt_tokens_while_decoding=64, mixed_token_budget=512, prefill_chunk_tokens=512)
    submit(ex, 10, 100, 1, now)
    jobs = drive(s, ex, now, {10})
    assert chunks(jobs, 10) == [64, 36]


def test_a_prompts_only_job_while_the_streams_step_in_another_job_in_flight_is_capped_too():
    """Ping/pong: the streams are all in the job in flight, so the next job has no decode lane; it still
    delays their next step by its whole cost, so it takes the cap, not the budget."""
    s, ex, now = decoding(prompt_tokens_while_decoding=64, mixed_token_budget=512, max_inflight=2,
                          pingpong_min_gain=0.0)
    submit(ex, 10, 300, 1, now)
    submit(ex, 11, 300, 1, now)  # a prompt is in one job at a time: the second job's is another one
    ex.handle(s.tick(now))
    (_, a), (_, b) = ex.pending
    assert streams_in(lanes_of(a)) == set(range(STREAMS)) and chunks([lanes_of(a)], 10) == [64]
    assert lanes_of(b) == [(11, 64, True)]


def test_without_decode_lanes_a_prompt_takes_the_whole_budget():
    s = make_scheduler(SchedulerConfig(prompt_tokens_while_decoding=64, mixed_token_budget=512), mixed=4096)
    ex = FakeExecutor(s)
    submit(ex, 10, 1000, 1, 0.0)
    ex.handle(s.tick(0.0))
    (_, job), = ex.pending
    assert lanes_of(job) == [(10, 512, True)]


def test_a_zero_cap_leaves_the_mixed_budget_alone():
    s, ex, now = decoding(prompt_tokens_while_decoding=0, mixed_token_budget=512)
    submit(ex, 10, 1000, 1, now)
    ex.handle(s.tick(now))
    (_, job), = ex.pending
    assert chunks([lanes_of(job)], 10) == [512 - STREAMS]


def test_a_prompt_that_cannot_be_chunked_still_goes_whole_as_a_jobs_first_while_a_long_one_is_chunked():
    """Prompt logprobs need the whole prompt in one job: above the cap it goes alone and whole in a job
    of its own turn (as without the cap), never waiting for the long prompt to finish."""
    s, ex, now = decoding(prompt_tokens_while_decoding=64, mixed_token_budget=512)
    submit(ex, 10, 1000, 1, now)  # medium class: 1000 / 64 = 16 jobs
    PROMPT_LEN[11] = 100
    ex.submit(11, params(n_prompt=100, max_tokens=1, seed=11, prompt_logprobs=0), now)  # short class
    jobs = drive(s, ex, now, {10, 11})
    (whole,) = [j for j in jobs if chunks([j], 11)]
    assert chunks([whole], 11) == [100] and not chunks([whole], 10)  # alone beside the streams, whole
    done_10 = max(i for i, j in enumerate(jobs) if chunks([j], 10))
    assert jobs.index(whole) < done_10


@pytest.mark.parametrize("how", ["config", "backend"])
def test_a_backend_that_cannot_chunk_keeps_running_the_whole_prompt_beside_the_streams(how):
    """Without chunked prefill the cap does not apply: a prompt above it could never go."""
    s = make_scheduler(SchedulerConfig(prompt_tokens_while_decoding=64, mixed_token_budget=512,
                                       chunked_prefill=how != "config"),
                       mixed=4096, max_seq=4096, chunked=how != "backend")
    ex = FakeExecutor(s)
    for i in range(2):
        submit(ex, i, 8, 50, 0.0)
    ex.step(0.0)
    assert len(s.chips[0].decode_ready) == 2
    submit(ex, 10, 300, 1, 0.001)
    submit(ex, 11, 100, 1, 0.001)  # beside the first prompt within the budget, as without the cap
    ex.handle(s.tick(0.001))
    (_, job), = ex.pending
    assert lanes_of(job) == [(0, 1, False), (1, 1, False), (10, 300, True), (11, 100, True)]
    ex.run(0.002)
    assert kv_fully_free(s)


def test_the_cap_is_a_batch_key_and_may_not_be_negative():
    from engine.config import load_config
    from engine.config_schema import ConfigError

    env = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    cfg = load_config(None, {"batch.prompt_tokens_while_decoding": 96}, env=env)
    assert scheduler_config_from(cfg).prompt_tokens_while_decoding == 96
    with pytest.raises(ConfigError, match="prompt_tokens_while_decoding"):
        load_config(None, {"batch.prompt_tokens_while_decoding": -1}, env=env)
    assert SchedulerConfig().prompt_tokens_while_decoding == 256
    with pytest.raises(ValueError, match="prompt_tokens_while_decoding"):
        SchedulerConfig(prompt_tokens_while_decoding=-1)


def test_the_streams_next_prompts_go_first_and_a_long_prompt_keeps_half_the_cap_every_job():
    """Scenario long-prompt over HTTP: a stream's next request is a short prompt, and the stream's gap runs
    until its first token, so it goes whole in the next job, before the long prompt's chunk; the long
    prompt keeps at least half the cap in every job, however many short prompts keep arriving."""
    cap = 64
    s, ex, now = decoding(prompt_tokens_while_decoding=cap, mixed_token_budget=512)
    submit(ex, 10, 1000, 1, now)
    ex.handle(s.tick(now))
    ex.complete_all(now)
    rid = 100
    while 10 not in ex.terminal:
        now += 0.001
        arrived = []
        for _ in range(3):  # three 20-token prompts a job: 60 of the 64 if they all went first
            submit(ex, rid, 20, 1, now)
            arrived.append(rid)
            rid += 1
        ex.handle(s.tick(now))
        (_, job), = ex.pending
        lanes = lanes_of(job)
        ex.complete_all(now)
        assert prompt_tokens(lanes) <= cap
        if 10 not in ex.terminal:
            assert chunks([lanes], 10) and chunks([lanes], 10)[0] >= cap // 2, lanes
        shorts = [(seed, n) for seed, n, p in lanes if seed >= 100 and p]
        assert shorts and all(n == 20 for _, n in shorts), lanes  # whole, one at least in every job
        if arrived[0] == 100:
            assert shorts[0][0] == 100  # the first to arrive goes at once, beside the long prompt's chunk
        assert rid < 1000, "the long prompt did not finish"
    assert ex.tokens[10] == [default_token(10, 1000)]
    ex.run(now)
    assert all(ex.tokens[r] == [default_token(r, 20)] for r in range(100, rid))  # every short prompt went too
