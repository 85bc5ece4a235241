"""admission.max_kv_tokens: the KV tokens admitted sequences may hold reserved, board-wide. Fake clock."""

from __future__ import annotations

from engine.core.actions import FailRequest, FinishRequest
from engine.core.scheduler_config import SchedulerConfig, scheduler_config_from
from test_scheduler_fakes import FakeExecutor, kv_fully_free, make_scheduler, params


def bound(s) -> set[int]:
    return {rid for ch in s.chips.values() for rid in ch.bound}


def test_admission_stops_at_max_kv_tokens_below_the_pool_and_resumes_as_sequences_finish():
    # The pool has 8192 tokens (512 blocks of 16); the limit lets two 40-token prompts in (41 + 41 reserved,
    # 48 + 48 once each grows to its first decode block), not a third.
    s = make_scheduler(SchedulerConfig(max_kv_tokens=100, max_inflight=4))
    ex = FakeExecutor(s)
    for rid in range(3):
        ex.submit(rid, params(n_prompt=40, max_tokens=4, seed=rid))
    ex.handle(s.tick(0.0))
    assert bound(s) == {0, 1} and s.admission_blocked == "kv"
    for step in range(1, 4):  # while the two decode, the third keeps waiting
        ex.step(step * 0.01)
        if ex.terminal:
            break
        assert 2 not in bound(s) and s.admission_blocked == "kv"
    ex.run(0.1)
    assert sorted(ex.terminal) == [0, 1, 2] and all(len(ex.tokens[rid]) == 4 for rid in range(3))
    assert kv_fully_free(s)


def test_without_the_limit_the_pool_admits_all():
    s = make_scheduler(SchedulerConfig(max_inflight=4))
    ex = FakeExecutor(s)
    for rid in range(3):
        ex.submit(rid, params(n_prompt=40, max_tokens=4, seed=rid))
    ex.handle(s.tick(0.0))
    assert bound(s) == {0, 1, 2} and s.admission_blocked is None


def test_a_prompt_that_alone_needs_more_than_the_limit_gets_400():
    s = make_scheduler(SchedulerConfig(max_kv_tokens=100))
    out = s.submit(1, params(n_prompt=100, max_tokens=4), 0.0)
    assert len(out) == 1 and isinstance(out[0], FailRequest)
    assert (out[0].code, out[0].reason) == (400, "context_too_long") and "max_kv_tokens" in out[0].message
    assert s.submit(2, params(n_prompt=99, max_tokens=4), 0.0) == []  # 99 + 1 fits exactly
    ex = FakeExecutor(s)
    ex.handle(s.tick(0.0))
    assert bound(s) == {2}


def test_a_limit_at_or_above_the_pool_changes_nothing():
    s = make_scheduler(SchedulerConfig(max_kv_tokens=64), num_blocks=4, block_size=16)  # the pool: 64 tokens
    assert s.budget.max_kv_tokens is None


def test_the_daemon_config_key_reaches_the_scheduler():
    cfg = scheduler_config_from({"admission": {"max_kv_tokens": 100}})
    assert cfg.max_kv_tokens == 100
    assert make_scheduler(cfg).budget.max_kv_tokens == 100
    assert scheduler_config_from({}).max_kv_tokens == 0


def test_requeued_sequences_give_their_reservation_back():
    """A chip fault unbinds every sequence: the reservation count returns to zero, so all are admitted again."""
    s = make_scheduler(SchedulerConfig(max_kv_tokens=100, max_inflight=4))
    ex = FakeExecutor(s)
    for rid in range(2):
        ex.submit(rid, params(n_prompt=40, max_tokens=4, seed=rid))
    ex.handle(s.tick(0.0))
    assert bound(s) == {0, 1}
    ex.pending.clear()  # the jobs are lost with the chip
    ex.handle(s.on_chip_down(0, 0.01))
    ex.handle(s.on_chip_up(0, 0.02))
    ex.handle(s.tick(0.03))
    assert bound(s) == {0, 1}
    ex.run(0.04)
    assert sorted(ex.terminal) == [0, 1] and all(isinstance(t, FinishRequest) for t in ex.terminal.values())
    assert kv_fully_free(s)
