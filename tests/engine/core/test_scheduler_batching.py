"""Continuous batching: lane selection by profile, inactive lanes, batching window, chunked prefill, WRR shares."""

from __future__ import annotations

import pytest

from engine.core.batch_profiles import lanes_for
from engine.core.scheduler_config import SchedulerConfig
from ipc.records import JobKind
from test_scheduler_fakes import FakeExecutor, decode_turn_gaps, kv_fully_free, make_scheduler, params

# (ready, expected B, expected active lanes) for profiles B1/B4/B8/B16, thresholds 3/6/12 (fill ratio 0.75)
LANE_TABLE = [(0, 0, 0), (1, 1, 1), (2, 1, 1), (3, 4, 3), (4, 4, 4), (5, 4, 4), (6, 8, 6), (7, 8, 7), (8, 8, 8),
              (11, 8, 8), (12, 16, 12), (15, 16, 15), (16, 16, 16), (17, 16, 16)]


@pytest.mark.parametrize("ready, b, lanes", LANE_TABLE)
def test_profile_and_lane_count_by_ready_count(ready, b, lanes):
    assert lanes_for(ready, (1, 4, 8, 16)) == (b, lanes)


def ready_sequences(n: int, **cfg):
    """A scheduler with n sequences prefilled and waiting for decode, and its executor."""
    s = make_scheduler(SchedulerConfig(max_inflight=64, **cfg))
    ex = FakeExecutor(s)
    for i in range(n):
        ex.submit(i, params(max_tokens=10, seed=i))
    ex.handle(s.tick(0.0))  # every prefill goes out (no decode is ready yet)
    assert [j.kind for _, j in ex.pending] == [JobKind.PREFILL] * n
    ex.complete_all(0.0)
    return s, ex


@pytest.mark.parametrize("ready, b, lanes", LANE_TABLE)
def test_first_decode_job_of_a_tick_follows_the_profile_policy(ready, b, lanes):
    s, ex = ready_sequences(ready)
    ex.handle(s.tick(0.01))
    decodes = [j for _, j in ex.pending]
    if ready == 0:
        assert decodes == []
        return
    first = decodes[0]
    assert first.kind == JobKind.DECODE and first.batch == b and int(first.lane_valid.sum()) == lanes
    assert list(first.lane_valid) == [1] * lanes + [0] * (b - lanes)  # active lanes first, then masked ones
    # every ready sequence got exactly one lane in this tick (remaining ones in further jobs)
    seeds = [int(j.seed[k]) for j in decodes for k in range(j.batch) if j.lane_valid[k]]
    assert sorted(seeds) == list(range(ready))


def test_inactive_lanes_are_masked_not_token_zero():
    s, ex = ready_sequences(3)
    ex.handle(s.tick(0.01))
    (_, job), = ex.pending
    assert job.batch == 4 and list(job.lane_valid) == [1, 1, 1, 0]
    assert job.context_lens[3] == 0 and (job.block_tables[3] == -1).all() and job.sample[3] == 0
    assert len(job.tokens) == 3  # the inactive lane carries no token at all


def test_decode_prefers_earliest_deadline():
    s = make_scheduler(SchedulerConfig(max_inflight=64), profiles=(1,))
    ex = FakeExecutor(s)
    ex.submit(1, params(max_tokens=5, seed=1, deadline_ms=9000))
    ex.submit(2, params(max_tokens=5, seed=2, deadline_ms=1000))
    ex.submit(3, params(max_tokens=5, seed=3))
    ex.handle(s.tick(0.0))
    ex.complete_all(0.0)
    ex.handle(s.tick(0.01))
    assert [int(j.seed[0]) for _, j in ex.pending] == [2, 1, 3]


def test_more_ready_lanes_than_the_largest_profile_take_turns():
    """20 ready for a B16, one job at a time: the strict order (deadline, fair-queue tag) kept the last four
    at their first token until the first sixteen finished; round robin serves each ready lane in turn."""
    s = make_scheduler(SchedulerConfig(max_inflight=1))
    ex = FakeExecutor(s)
    for i in range(20):
        ex.submit(i, params(max_tokens=100, seed=i))
    now = 0.0
    while not ex.terminal:
        ex.step(now)
        now += 0.01
    got = [len(ex.tokens.get(i, [])) for i in range(20)]
    assert min(got) >= max(got) // 2, got
    assert max(decode_turn_gaps(ex.jobs).values()) <= 3


def test_tenant_lane_share_is_capped_unless_nobody_else_is_ready():
    s = make_scheduler(SchedulerConfig(max_inflight=64, max_tenant_lane_share=0.5), profiles=(4,))
    ex = FakeExecutor(s)
    for i in range(6):
        ex.submit(i, params(max_tokens=5, seed=i, tenant="a"))
    ex.submit(6, params(max_tokens=5, seed=6, tenant="b"))
    ex.handle(s.tick(0.0))
    ex.complete_all(0.0)
    ex.handle(s.tick(0.01))
    first = ex.pending[0][1]
    seeds = [int(first.seed[k]) for k in range(4) if first.lane_valid[k]]
    # 2 lanes for "a" (50 %), then b, then the free lane goes to "a" again since nobody else waits
    assert len(seeds) == 4 and 6 in seeds and sum(sd < 6 for sd in seeds) == 3


def test_batching_window_holds_then_always_fires():
    s = make_scheduler(SchedulerConfig(batching_window_s=0.05))
    ex = FakeExecutor(s)
    ex.submit(1, params(max_tokens=3))
    ex.step(0.0)  # prefill done at t=0: the sequence is ready, the batch has 1 of 16 lanes
    assert s.tick(0.01) == []
    assert s.next_wakeup(0.01) == pytest.approx(0.05)
    assert s.tick(0.049) == []
    out = s.tick(0.05)
    assert len(out) == 1 and out[0].job.kind == JobKind.DECODE


def test_batching_window_never_lets_the_earliest_deadline_slip():
    s = make_scheduler(SchedulerConfig(batching_window_s=0.05))
    ex = FakeExecutor(s)
    ex.submit(1, params(max_tokens=3, deadline_ms=80))
    ex.step(0.0)
    # holding the full window (to 0.05) would leave less than a window before the 0.08 deadline
    assert s.next_wakeup(0.0) <= 0.08 - 0.05 + 1e-9
    out = s.tick(0.03)
    assert len(out) == 1 and out[0].job.kind == JobKind.DECODE


def test_batching_window_does_not_hold_a_full_batch():
    s = make_scheduler(SchedulerConfig(batching_window_s=10.0, max_inflight=64), profiles=(1, 4))
    ex = FakeExecutor(s)
    for i in range(4):
        ex.submit(i, params(max_tokens=3, seed=i))
    ex.handle(s.tick(0.0))
    ex.complete_all(0.0)
    out = s.tick(0.0)
    assert len(out) == 1 and int(out[0].job.lane_valid.sum()) == 4


@pytest.mark.parametrize("n_prompt", [15, 16, 17, 33])
def test_chunk_boundaries_are_contiguous_and_only_the_last_chunk_samples(n_prompt):
    s = make_scheduler(SchedulerConfig(prefill_chunk_tokens=16), block_size=16)
    ex = FakeExecutor(s)
    p = params(n_prompt=n_prompt, max_tokens=2, seed=7)
    ex.submit(1, p)
    ex.run()
    chunks = [j for _, j in ex.jobs if j.kind == JobKind.PREFILL]
    assert len(chunks) == -(-n_prompt // 16)
    pos = 0
    for k, j in enumerate(chunks):
        assert j.batch == 1 and int(j.positions[0]) == pos and len(j.tokens) <= 16
        assert list(j.tokens) == p.prompt[pos:pos + len(j.tokens)]
        pos += len(j.tokens)
        assert int(j.context_lens[0]) == pos
        assert int(j.sample[0]) == (k == len(chunks) - 1)
    assert pos == n_prompt
    assert len(ex.tokens[1]) == 2 and kv_fully_free(s)


def decode_run(chunked: bool):
    """16 sequences decoding, then a 4096-token prompt arrives; returns the job list after it arrived."""
    s = make_scheduler(SchedulerConfig(prefill_chunk_tokens=512), chunked=chunked, max_seq=8192, num_blocks=2048)
    ex = FakeExecutor(s)
    for i in range(16):
        ex.submit(i, params(max_tokens=200, seed=i))
    now = 0.0
    for _ in range(60):  # all 16 prefilled (decode:short = 8:4), decoding steadily
        ex.step(now)
        now += 0.02
    mark = len(ex.jobs)
    ex.submit(100, params(n_prompt=4096, max_tokens=4, seed=100), now)
    while 100 not in ex.tokens:
        ex.step(now)
        now += 0.02
    return ex.jobs[mark:]


def test_chunked_prefill_interleaves_a_long_prompt_with_running_decodes():
    jobs = decode_run(chunked=True)
    prefill = [j for _, j in jobs if j.kind == JobKind.PREFILL and int(j.seed[0]) == 100]
    assert len(prefill) == 8 and max(len(j.tokens) for j in prefill) == 512
    # between two consecutive decode steps at most one chunk of <= 512 tokens runs
    gap = 0
    for _, j in jobs:
        if j.kind == JobKind.DECODE:
            gap = 0
        else:
            gap += len(j.tokens)
            assert gap <= 512
    unchunked = [j for _, j in decode_run(chunked=False) if j.kind == JobKind.PREFILL and int(j.seed[0]) == 100]
    assert [len(j.tokens) for j in unchunked] == [4096]


def test_long_prefill_gets_its_minimum_share_under_constant_decode():
    # decode:long = 8:1 -> a long prompt's chunks get >= 1 of every 9 job opportunities
    s = make_scheduler(SchedulerConfig(prefill_chunk_tokens=512), max_seq=16384, num_blocks=4096)
    ex = FakeExecutor(s)
    for i in range(16):
        ex.submit(i, params(max_tokens=1000, seed=i))
    now = 0.0
    for _ in range(60):
        ex.step(now)
        now += 0.02
    mark = len(ex.jobs)
    ex.submit(100, params(n_prompt=8192, max_tokens=2, seed=100), now)  # > 4096: the long class
    for _ in range(144):
        ex.step(now)
        now += 0.02
    window = [j for _, j in ex.jobs[mark:mark + 144]]
    assert all(j.kind == JobKind.DECODE or int(j.seed[0]) == 100 for j in window)
    long_chunks = [j for j in window if j.kind == JobKind.PREFILL]
    assert len(long_chunks) == 144 // 9  # exactly its share: all 16 chunks
    assert 100 in ex.tokens  # its prefill completed while decode kept running
    assert sum(j.kind == JobKind.DECODE for j in window) == 144 * 8 // 9
