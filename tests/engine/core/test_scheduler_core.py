"""Scheduler core end to end with a fake executor and a fake clock: lifecycle, admission, cancel, faults."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.actions import FailRequest, FinishRequest, SubmitJob
from engine.core.requests import GenerateParams, RequestState
from engine.config_schema import ConfigError
from engine.core.scheduler_config import SchedulerConfig, TenantPolicy
from ipc.records import JobKind, JobResult, JobStatus
from test_scheduler_fakes import VOCAB, FakeExecutor, default_token, kv_fully_free, make_scheduler, params


def expected_tokens(p: GenerateParams, n: int) -> list[int]:
    start = len(p.prompt) + len(p.continuation)
    return [default_token(p.seed, pos) for pos in range(start, start + n)]


def test_requests_complete_with_seeded_tokens_and_usage():
    s = make_scheduler()
    ex = FakeExecutor(s)
    ps = {i: params(n_prompt=10 + i, max_tokens=5 + i % 3, seed=i) for i in range(12)}
    for i, p in ps.items():
        ex.submit(i, p)
    ex.run()
    for i, p in ps.items():
        assert ex.tokens[i] == expected_tokens(p, p.max_tokens)
        done = ex.terminal[i]
        assert isinstance(done, FinishRequest) and done.finish_reason == "length"
        assert done.usage == {"prompt_tokens": len(p.prompt), "completion_tokens": p.max_tokens, "cached_tokens": 0}
        assert set(done.timing) == {"ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"}
    assert kv_fully_free(s)
    assert not s.has_work()


def test_decode_lane_input_is_last_sampled_token_at_committed_position():
    s = make_scheduler(profiles=(1,))
    ex = FakeExecutor(s)
    p = params(n_prompt=7, max_tokens=3, seed=5)
    ex.submit(1, p)
    ex.run()
    decodes = [j for _, j in ex.jobs if j.kind == JobKind.DECODE]
    assert len(decodes) == 2
    toks = expected_tokens(p, 3)
    for k, j in enumerate(decodes):
        assert int(j.tokens[0]) == toks[k]
        assert int(j.positions[0]) == 7 + k
        assert int(j.context_lens[0]) == 8 + k


@pytest.mark.parametrize("p, reason", [
    (GenerateParams(prompt=[], max_tokens=4), "empty_prompt"),
    (GenerateParams(prompt=[1, VOCAB], max_tokens=4), "token_out_of_range"),
    (GenerateParams(prompt=[1, -1], max_tokens=4), "token_out_of_range"),
    (GenerateParams(prompt=[1] * 100, max_tokens=2000), "context_too_long"),
    (GenerateParams(prompt=[1], max_tokens=0), "invalid_max_tokens"),
])
def test_invalid_requests_get_400_at_once(p, reason):
    s = make_scheduler(max_seq=2048)
    out = s.submit(1, p, 0.0)
    assert len(out) == 1 and isinstance(out[0], FailRequest)
    assert (out[0].code, out[0].reason, out[0].retryable) == (400, reason, False)
    assert not s.has_work()


def test_429_when_waiting_budget_full_and_503_when_not_accepting():
    s = make_scheduler(SchedulerConfig(max_waiting_requests=2, max_waiting_prompt_tokens=100))
    assert s.submit(1, params(n_prompt=10), 0.0) == []
    assert s.submit(2, params(n_prompt=10), 0.0) == []
    (r,) = s.submit(3, params(n_prompt=10), 0.0)
    assert (r.code, r.reason, r.retryable) == (429, "queue_full", True)
    s2 = make_scheduler(SchedulerConfig(max_waiting_prompt_tokens=30))
    assert s2.submit(1, params(n_prompt=20), 0.0) == []
    (r,) = s2.submit(2, params(n_prompt=20), 0.0)
    assert (r.code, r.reason) == (429, "queue_tokens_full")
    s.set_accepting(False, "draining")
    (r,) = s.submit(4, params(), 0.0)
    assert (r.code, r.reason, r.retryable) == (503, "draining", True)


def test_waiting_budget_frees_when_requests_are_admitted():
    s = make_scheduler(SchedulerConfig(max_waiting_requests=1))
    ex = FakeExecutor(s)
    ex.submit(1, params())
    ex.handle(s.tick(0.0))  # admitted: out of the waiting budget
    assert s.submit(2, params(seed=2), 0.0) == []


def test_cancel_waiting_ready_and_running_is_idempotent_and_reclaims_kv():
    s = make_scheduler(SchedulerConfig(max_sequences=2))
    ex = FakeExecutor(s)
    for i in range(3):
        ex.submit(i, params(max_tokens=50, seed=i))
    ex.handle(s.tick(0.0))  # 0 and 1 admitted, 0's prefill in flight; 2 waits
    assert len(ex.pending) == 1
    ex.handle(s.cancel(2, 0.0))  # waiting
    ex.handle(s.cancel(1, 0.0))  # admitted, not running
    ex.handle(s.cancel(0, 0.0))  # running: terminal now, KV after the job drains
    for i in range(3):
        assert ex.terminal[i].finish_reason == "cancelled"
    assert s.cancel(0, 0.0) == [] and s.cancel(99, 0.0) == []
    assert s.has_work()  # the in-flight job still holds its KV
    ex.complete_all(0.0)
    assert 0 not in ex.tokens  # the lane's output was dropped
    assert kv_fully_free(s) and not s.has_work()


def test_deadline_gives_504_at_next_tick_waiting_or_running():
    s = make_scheduler(SchedulerConfig(max_sequences=1))
    ex = FakeExecutor(s)
    ex.submit(1, params(max_tokens=100, deadline_ms=50), now=0.0)
    ex.submit(2, params(max_tokens=100, deadline_ms=30, seed=2), now=0.0)
    ex.handle(s.tick(0.0))
    assert s.next_wakeup(0.0) == pytest.approx(0.03)
    ex.handle(s.tick(0.029))
    assert 2 not in ex.terminal
    ex.handle(s.tick(0.03))
    assert (ex.terminal[2].code, ex.terminal[2].reason) == (504, "deadline_exceeded")
    ex.complete_all(0.03)
    ex.handle(s.tick(0.05))
    assert ex.terminal[1].code == 504
    ex.complete_all(0.05)
    assert kv_fully_free(s) and not s.has_work()


def test_result_with_wrong_generation_or_unknown_job_is_dropped_but_resources_reclaimed():
    s = make_scheduler()
    ex = FakeExecutor(s)
    ex.submit(1, params(max_tokens=3))
    ex.handle(s.tick(0.0))
    chip, job = ex.pending.pop()
    bogus = JobResult(job_id=12345, generation=1, kind=JobKind.PREFILL, status=JobStatus.OK,
                      tokens=np.array([5], np.int32), logprobs=np.zeros(1, np.float32))
    assert s.on_result(chip, bogus, 0.0) == []
    stale = ex.result_for(job)
    stale.generation = 99
    ex.handle(s.on_result(chip, stale, 0.0))  # lane requeued: no token had been emitted
    assert 1 not in ex.terminal and 1 not in ex.tokens
    assert s.stats()["counters"]["stale_results"] == 2
    # the late real result of the same job is stale too: dropped
    assert s.on_result(chip, ex.result_for(job), 0.0) == []
    kv = s.chips[chip].kv
    assert kv.stats()["blocks"]["quarantined"] > 0  # the stale job's KV is Unknown
    ex.run()
    assert ex.tokens[1] == expected_tokens(params(max_tokens=3), 3)


def test_failed_job_requeues_before_first_token_and_500s_after():
    s = make_scheduler(profiles=(1,))
    ex = FakeExecutor(s)
    ex.submit(1, params(max_tokens=5))
    ex.handle(s.tick(0.0))
    ex.fail_jobs.add(ex.pending[0][1].job_id)  # the prefill fails: retried
    ex.complete_all(0.0)
    assert 1 not in ex.terminal
    ex.step(0.01)  # prefill again, ok
    ex.handle(s.tick(0.02))
    ex.fail_jobs.add(ex.pending[0][1].job_id)  # a decode fails after a token was emitted
    ex.complete_all(0.02)
    t = ex.terminal[1]
    assert (t.code, t.reason, t.retryable) == (500, "job_failed", True)
    assert ex.tokens[1] == expected_tokens(params(max_tokens=5), 1)


def test_job_timeout_fails_lanes_and_late_result_is_stale():
    s = make_scheduler(SchedulerConfig(job_timeout_s=1.0, max_retries=0))
    ex = FakeExecutor(s)
    ex.submit(1, params())
    ex.handle(s.tick(0.0))
    assert s.next_wakeup(0.0) == pytest.approx(1.0)
    ex.handle(s.tick(1.0))
    assert (ex.terminal[1].code, ex.terminal[1].reason) == (500, "job_timeout")
    ex.complete_all(1.0)  # late answer
    assert s.stats()["counters"]["stale_results"] == 1


def test_chip_down_requeues_unstarted_fails_streaming_and_chip_up_restores_service():
    s = make_scheduler(chips=2, profiles=(1, 4))
    ex = FakeExecutor(s)
    for i in range(4):
        ex.submit(i, params(max_tokens=20, seed=i))
    ex.step(0.0)  # prefills done: two sequences per chip, each with one token emitted
    ex.handle(s.tick(0.01))  # decode jobs in flight on both chips
    assert {c for c, _ in ex.pending} == {0, 1}
    ex.submit(10, params(max_tokens=3, seed=10), now=0.01)
    ex.handle(s.on_chip_down(0, 0.02))
    failed = {rid for rid, t in ex.terminal.items() if isinstance(t, FailRequest)}
    assert failed and all(ex.terminal[r].code == 500 and ex.terminal[r].retryable for r in failed)
    ex.pending = [(c, j) for c, j in ex.pending if c != 0]  # the dead worker never answers
    ex.run(now=0.03)
    assert set(ex.terminal) == {0, 1, 2, 3, 10}
    assert ex.tokens[10] == expected_tokens(params(max_tokens=3, seed=10), 3)
    assert s.chips[0].kv.stats()["faulted"]
    ex.handle(s.on_chip_up(0, 1.0))
    assert s.chips[0].in_service and s.chips[0].kv.available_blocks() == 512
    for i in range(20, 28):
        ex.submit(i, params(max_tokens=2, seed=i), now=1.0)
    ex.run(now=1.0)
    assert any(c == 0 for c, j in ex.jobs[-8:])
    assert kv_fully_free(s)


def test_in_flight_lane_that_emitted_no_token_is_requeued_on_chip_failure():
    """The lanes of prefill jobs on the chip when it dies, none of which has
    emitted a token: each is requeued (no 500), recomputed on the other chip,
    and streams exactly the tokens of a run without the fault."""
    s = make_scheduler(chips=2, profiles=(1, 4))
    ex = FakeExecutor(s)
    ps = {i: params(n_prompt=20, max_tokens=5, seed=i) for i in range(4)}
    for i, p in ps.items():
        ex.submit(i, p)
    ex.handle(s.tick(0.0))  # prefill jobs submitted, none answered
    on_chip0 = {rid for c, j in ex.pending if c == 0 for rid in s.chips[0].inflight[j.job_id].lanes}
    assert on_chip0 and not ex.tokens, "the chip must go down with unanswered lanes that emitted nothing"
    assert all(j.kind == JobKind.PREFILL for c, j in ex.pending if c == 0)
    before = len(ex.jobs)
    ex.handle(s.on_chip_down(0, 0.01))
    assert ex.terminal == {}, "a lane that emitted no token must be requeued, not failed"
    assert s.stats()["counters"]["requeued"] >= len(on_chip0)
    ex.pending = [(c, j) for c, j in ex.pending if c != 0]  # the dead worker never answers
    ex.run(now=0.02)
    for i, p in ps.items():
        assert isinstance(ex.terminal[i], FinishRequest) and ex.terminal[i].finish_reason == "length"
        assert ex.tokens[i] == expected_tokens(p, 5)
    assert {c for c, _ in ex.jobs[before:]} == {1}  # recomputed on the chip still in service


def test_chip_down_requeues_idle_sequences_with_their_tokens():
    s = make_scheduler(chips=2, profiles=(1,))
    ex = FakeExecutor(s)
    ex.submit(1, params(max_tokens=6, seed=3))
    ex.step(0.0)
    ex.step(0.01)  # two tokens emitted, sequence idle between jobs
    chip = next(ch.chip for ch in s.chips.values() if ch.bound)
    ex.handle(s.on_chip_down(chip, 0.02))
    assert 1 not in ex.terminal
    ex.run(now=0.03)
    assert ex.tokens[1] == expected_tokens(params(max_tokens=6, seed=3), 6)


def test_shutdown_gives_every_live_request_one_503_and_drains():
    s = make_scheduler(SchedulerConfig(max_sequences=2))
    ex = FakeExecutor(s)
    for i in range(4):
        ex.submit(i, params(max_tokens=30, seed=i))
    ex.handle(s.tick(0.0))
    ex.handle(s.shutdown(0.0))
    assert {r: (t.code, t.reason) for r, t in ex.terminal.items()} == {i: (503, "shutdown") for i in range(4)}
    (r,) = s.submit(9, params(), 0.0)
    assert (r.code, r.reason) == (503, "shutdown")
    ex.complete_all(0.0)
    assert kv_fully_free(s) and not s.has_work()


def test_continuation_counts_toward_max_tokens_and_is_not_reemitted():
    s = make_scheduler()
    ex = FakeExecutor(s)
    p = params(n_prompt=6, max_tokens=5, seed=4, continuation=[11, 12])
    ex.submit(1, p)
    ex.run()
    assert ex.tokens[1] == expected_tokens(p, 3)
    assert ex.terminal[1].finish_reason == "length" and ex.terminal[1].usage["completion_tokens"] == 3
    first_prefill = next(j for _, j in ex.jobs if j.kind == JobKind.PREFILL)
    assert list(first_prefill.tokens[-2:]) == [11, 12]  # the continuation is context
    # a continuation that already used up max_tokens finishes at once
    out = s.submit(2, params(max_tokens=2, continuation=[5, 6]), 0.0)
    assert len(out) == 1 and isinstance(out[0], FinishRequest) and out[0].finish_reason == "length"


def test_profile_the_model_lacks_fails_at_configuration():
    with pytest.raises(ConfigError):
        make_scheduler(SchedulerConfig(profiles=(1, 8)), profiles=(1, 4))
    s = make_scheduler(SchedulerConfig(profiles=(4,)), profiles=(1, 4, 8))
    assert s.profiles == (4,)


def test_chunked_prefill_off_when_model_does_not_declare_it():
    s = make_scheduler(SchedulerConfig(prefill_chunk_tokens=16), chunked=False)
    ex = FakeExecutor(s)
    ex.submit(1, params(n_prompt=100, max_tokens=1))
    ex.run()
    prefills = [j for _, j in ex.jobs if j.kind == JobKind.PREFILL]
    assert len(prefills) == 1 and len(prefills[0].tokens) == 100


def test_next_wakeup_is_now_after_events_and_none_when_idle():
    s = make_scheduler()
    assert s.next_wakeup(0.0) is None
    s.submit(1, params(), 5.0)
    assert s.next_wakeup(5.0) == 5.0
    out = s.tick(5.0)
    assert any(isinstance(a, SubmitJob) for a in out)
    assert s.next_wakeup(5.0) > 5.0  # only the deadline / job timeout remain


def test_kv_pressure_preempts_and_recomputes_without_losing_tokens():
    s = make_scheduler(SchedulerConfig(max_inflight=2, kv_watermark=0.0), num_blocks=24, block_size=16)
    ex = FakeExecutor(s)
    ps = {i: params(n_prompt=40, max_tokens=80, seed=i) for i in range(6)}
    for i, p in ps.items():
        ex.submit(i, p)
    ex.run()
    assert s.stats()["counters"]["preemptions"] > 0
    for i, p in ps.items():
        assert ex.tokens[i] == expected_tokens(p, 80)
    assert kv_fully_free(s)


def test_scheduler_config_from_engine_config():
    from engine.config import Config
    from engine.core.scheduler_config import scheduler_config_from

    from engine.config import TenantConfig

    cfg = scheduler_config_from(Config())
    assert cfg.decode_weight == 8 and cfg.max_inflight == 1 and cfg.job_timeout_s == 30.0
    assert cfg.profiles is None and cfg.default_deadline_s == 120.0
    s = make_scheduler(cfg)  # [] profiles = every profile the model declares
    assert s.profiles == (1, 4, 8, 16)
    cfg = scheduler_config_from({"queues": {"tenants": {"a": TenantConfig(weight=2.0)}},
                                 "batch": {"profiles": (1, 4), "batching_window_us": 500}})
    assert cfg.tenant("a") == TenantPolicy(weight=2.0) and cfg.profiles == (1, 4)
    assert cfg.batching_window_s == 0.0005


def test_freed_blocks_are_released_to_the_chip_before_the_next_job():
    """A finished request's blocks that the prefix cache does not keep are announced (ReleaseBlocks),
    before any job that could reuse them; cached full blocks are not."""
    sched = make_scheduler(block_size=4)
    ex = FakeExecutor(sched)
    ex.submit(1, params(n_prompt=10, max_tokens=4))  # 13 tokens of KV over 4 blocks: 3 full + 1 partial
    ex.run()
    table = {b for _, job in ex.jobs for b in job.block_tables[0].tolist() if b >= 0}
    assert len(table) == 4 and not ex.released  # nothing announced yet: no job since
    kv = sched.chips[0].kv
    cached = {b for b in table if kv.cache.is_cached(b)}
    assert len(cached) == 3
    ex.submit(2, params(n_prompt=6, max_tokens=2, seed=5))
    actions = sched.tick(1.0)
    kinds = [type(a).__name__ for a in actions]
    assert kinds.index("ReleaseBlocks") < kinds.index("SubmitJob")
    ex.handle(actions)
    assert {b for _, b in ex.released} == table - cached
    ex.complete_all(1.0)
    ex.run(1.0)
    assert kv_fully_free(sched)


def test_the_view_reads_live_requests_and_tenants_and_cannot_change_them():
    s = make_scheduler()
    ex = FakeExecutor(s)
    ex.submit(1, params(tenant="t"))
    ex.handle(s.tick(0.0))
    assert s.view.request(1) is s.view.requests[1] and s.view.request(1).state is RequestState.PREFILL_RUNNING
    assert s.view.tenant_active("t") == 1 and s.view.tenant_active("nobody") == 0
    with pytest.raises(TypeError):
        s.view.requests[2] = s.view.requests[1]  # read-only
    with pytest.raises(AttributeError):
        s.counters = {}  # the scheduler's public state is read, not replaced
    ex.run()
    assert not s.view.requests and s.view.request(1) is None and s.view.tenant_active("t") == 0
