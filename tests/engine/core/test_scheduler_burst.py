"""A burst of prompts on an idle chip (mixed batches): its streams start together, then step together.

The shape of `npuserve bench serve peer --concurrency 32` (Gemma on llamacpp: profiles up to 32,
n_batch 4096, 32 prompts of 128 tokens, 64 out each). With the 512-token budget alone the prompts
went three a job beside the lanes already started, so the first streams finished ten jobs before
the last and those ten jobs ran 28, 25, ... 1 lanes (74 jobs, 27.2 lanes a job); llama.cpp's server
takes the burst in two n_batch (2048) batches and steps all 32 streams together.
"""

from __future__ import annotations

from engine.core.scheduler_config import SchedulerConfig
from test_scheduler_fakes import FakeExecutor, make_scheduler, params

GEMMA = dict(profiles=(1, 2, 4, 8, 16, 32), max_seq=4096, mixed=4096, num_blocks=512, block_size=16)


def shapes(ex: FakeExecutor, s, now: float = 0.0) -> list[tuple[int, int]]:
    """(decode lanes, prompt tokens) of every job until the scheduler is idle, one job at a time."""
    out = []
    for _ in range(10_000):
        if not s.has_work():
            return out
        ex.handle(s.tick(now))
        for _, job in ex.pending:
            qs = job.query_start
            counts = [int(qs[k + 1] - qs[k]) for k in range(job.batch) if job.lane_valid[k]]
            out.append((sum(1 for n in counts if n == 1), sum(n for n in counts if n > 1)))
        ex.complete_all(now)
        now += 0.01
    raise AssertionError("the scheduler did not become idle")


def burst(cfg: SchedulerConfig, n: int = 32) -> list[tuple[int, int]]:
    s = make_scheduler(cfg, **GEMMA)
    ex = FakeExecutor(s)
    for i in range(n):
        ex.submit(i, params(n_prompt=128, max_tokens=64, seed=i))
    return shapes(ex, s)


def test_a_burst_on_an_idle_chip_starts_in_two_jobs_and_its_streams_step_together():
    jobs = burst(SchedulerConfig())
    # llama.cpp's server's schedule: 16 prompts; their first decode beside 15 more (the 16th does not fit
    # the 2048 and is not split); the first stream's second step beside the last prompt, in a 512 budget
    assert jobs[:3] == [(0, 2048), (16, 1920), (31, 128)]
    assert all(lanes == 32 and tokens == 0 for lanes, tokens in jobs[3:-2])
    assert jobs[-2:] == [(16, 0), (1, 0)]
    assert sum(lanes for lanes, _ in jobs) == 32 * 63 and len(jobs) == 66


def test_without_the_burst_budget_the_burst_starts_in_512_token_stages_and_ends_ragged():
    """The schedule the rule replaces (burst_token_budget 0: off, and no prompt cap while decoding), counted as
    bench-peer printed it."""
    jobs = burst(SchedulerConfig(burst_token_budget=0, prompt_tokens_while_decoding=0))
    assert jobs[:3] == [(0, 512), (4, 384), (7, 384)]
    assert [lanes for lanes, _ in jobs[-10:]] == [28, 25, 22, 19, 16, 13, 10, 7, 4, 1]
    assert len(jobs) == 74


def test_streams_already_decoding_keep_the_512_token_budget_and_the_prompt_cap_when_a_burst_arrives():
    s = make_scheduler(SchedulerConfig(), **GEMMA)
    ex = FakeExecutor(s)
    for i in range(4):
        ex.submit(i, params(n_prompt=16, max_tokens=200, seed=i))
    for step in range(3):  # the prompts' job, then two decode steps: the four streams are decoding
        ex.step(step * 0.01)
    assert all(s.view.requests[i].generated > 1 for i in range(4))
    for i in range(10, 42):
        ex.submit(i, params(n_prompt=128, max_tokens=4, seed=i), now=0.05)
    jobs = shapes(ex, s, now=0.05)
    # four lanes and two 128-token prompts (the prompt cap while decoding, 256), not a 2048 job
    assert jobs[0] == (4, 256)
    assert all(lanes + tokens <= 512 for lanes, tokens in jobs)


def test_a_job_in_flight_with_a_decoding_stream_keeps_the_512_token_budget():
    """Ping/pong: the other job in flight carries the decoding streams, so none is ready, yet a big job
    would stall them."""
    s = make_scheduler(SchedulerConfig(max_inflight=2, pingpong_min_gain=0.0), **GEMMA)
    ex = FakeExecutor(s)
    for i in range(4):
        ex.submit(i, params(n_prompt=16, max_tokens=200, seed=i))
    for step in range(3):
        ex.step(step * 0.01)
    ex.handle(s.tick(0.04))  # a decode job of the four streams goes out and stays in flight
    (_, running), = ex.pending
    assert sum(running.lane_valid) == 4
    for i in range(10, 42):
        ex.submit(i, params(n_prompt=128, max_tokens=4, seed=i), now=0.05)
    ex.handle(s.tick(0.05))
    assert len(ex.pending) == 2
    _, job = ex.pending[1]
    assert int(job.query_start[job.batch]) <= 512


def test_the_burst_budget_is_at_most_the_backends_limit_and_never_below_the_mixed_budget():
    assert make_scheduler(SchedulerConfig(burst_token_budget=8192), **GEMMA).planner.burst_budget == 4096
    assert make_scheduler(SchedulerConfig(burst_token_budget=100), **GEMMA).planner.burst_budget == 512
    assert make_scheduler(SchedulerConfig(mixed_token_budget=0), **GEMMA).planner.burst_budget == 4096


def test_long_prompts_in_a_burst_take_chunks_within_the_cap_and_the_short_prompts_go_whole_first():
    """The long-prompt scenario's moment: six streams' next 64-token prompts and two 1,500-token prompts
    reach an idle chip together. The burst budget is for whole prompts; a long prompt's chunks in it stay
    within the cap while decoding (256), so the streams' first tokens do not wait for 1,408 prompt tokens
    (and then their second for the second long prompt's 512)."""
    s = make_scheduler(SchedulerConfig(), **GEMMA)
    ex = FakeExecutor(s)
    for i in range(6):
        ex.submit(i, params(n_prompt=64, max_tokens=64, seed=i))
    for i in (10, 11):
        ex.submit(i, params(n_prompt=1500, max_tokens=8, seed=i))
    jobs = shapes(ex, s)
    assert jobs[0] == (0, 6 * 64 + 256)
    assert all(tokens <= 256 for lanes, tokens in jobs[1:] if lanes)  # the cap, once the streams decode
    assert sum(tokens for _, tokens in jobs) == 6 * 64 + 2 * 1500


def test_a_burst_of_whole_prompts_still_fills_the_burst_budget_beside_a_long_prompt():
    s = make_scheduler(SchedulerConfig(), **GEMMA)
    ex = FakeExecutor(s)
    for i in range(24):
        ex.submit(i, params(n_prompt=64, max_tokens=4, seed=i))
    ex.submit(50, params(n_prompt=1500, max_tokens=4, seed=50))
    jobs = shapes(ex, s)
    assert jobs[0] == (0, 24 * 64 + 256)  # every whole prompt (1,536 > the 512 budget), the long one's cap
