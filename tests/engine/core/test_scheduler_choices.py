"""`n` > 1 in the scheduler: one prompt computation shared by the choices, seeded streams, cancel, fairness."""

from __future__ import annotations

import dataclasses

from engine.core.requests import RequestState
from engine.core.scheduler_config import SchedulerConfig
from engine.core.sched.choices import choice_seed
from tests.engine.core.test_scheduler_fakes import FakeExecutor, kv_fully_free, make_scheduler, params

PROMPT = 40  # two full 16-token blocks and an 8-token partial one


def _n1_tokens(p, k: int) -> list[int]:
    s = make_scheduler()
    ex = FakeExecutor(s)
    ex.submit(1, dataclasses.replace(p, seed=choice_seed(p.seed, k)))
    ex.run()
    return ex.tokens[1]


def test_n4_computes_the_prompt_once_and_each_choice_is_its_seeded_n1():
    s = make_scheduler()
    ex = FakeExecutor(s)
    p = params(n_prompt=PROMPT, max_tokens=5, seed=7)
    ex.handle(s.submit_choices([10, 11, 12, 13], p, 0.0))
    ex.run()
    c = s.stats()["counters"]
    # the prompt once, then per other choice only the tokens after its last full block
    assert c["prefill_tokens"] == PROMPT + 3 * (PROMPT - 32)
    assert c["prefix_hit_tokens"] == 3 * 32
    assert c["choices_forked"] == 3
    for k, rid in enumerate([10, 11, 12, 13]):
        assert ex.terminal[rid].finish_reason == "length"
        assert ex.tokens[rid] == _n1_tokens(p, k), k
    assert len({tuple(ex.tokens[r]) for r in (10, 11, 12, 13)}) == 4
    assert kv_fully_free(s)


def test_choices_wait_for_the_leaders_prompt():
    s = make_scheduler()
    ex = FakeExecutor(s)
    ex.handle(s.submit_choices([1, 2, 3], params(n_prompt=PROMPT, max_tokens=3), 0.0))
    ex.handle(s.tick(0.0))
    prefill_lanes = [int(j.lane_valid.sum()) for _, j in ex.pending]
    assert prefill_lanes == [1]  # the leader alone: its siblings would compute the prompt again
    assert s.view.request(2) is None and s.has_work()


def test_cancel_ends_every_choice_held_or_running():
    s = make_scheduler()
    ex = FakeExecutor(s)
    ex.handle(s.submit_choices([1, 2, 3], params(n_prompt=PROMPT, max_tokens=50), 0.0))
    ex.handle(s.tick(0.0))  # leader prefilling, siblings held
    for rid in (1, 2, 3):
        ex.handle(s.cancel(rid, 0.0))
    ex.run(0.01)
    assert {rid: t.finish_reason for rid, t in ex.terminal.items()} == {1: "cancelled", 2: "cancelled",
                                                                        3: "cancelled"}
    assert ex.terminal[2].usage["completion_tokens"] == 0
    assert not s.has_work() and kv_fully_free(s)


def test_every_choice_counts_against_the_sequence_budget():
    s = make_scheduler(SchedulerConfig(max_sequences=2))
    ex = FakeExecutor(s)
    ex.handle(s.submit_choices([1, 2, 3], params(n_prompt=PROMPT, max_tokens=4), 0.0))
    ex.step(0.0)  # leader's prompt computed: its siblings are submitted
    ex.handle(s.tick(0.01))
    states = [s.view.request(rid).state for rid in (1, 2, 3)]
    assert states.count(RequestState.WAITING_ADMISSION) == 1  # the third choice waits for a sequence
    ex.run(0.02)
    assert all(ex.terminal[rid].finish_reason == "length" for rid in (1, 2, 3))


def test_shutdown_ends_held_choices_too():
    s = make_scheduler()
    ex = FakeExecutor(s)
    ex.handle(s.submit_choices([1, 2], params(n_prompt=PROMPT, max_tokens=4), 0.0))
    ex.handle(s.tick(0.0))
    ex.handle(s.shutdown(0.0))
    assert set(ex.terminal) == {1, 2}


def test_a_refused_request_refuses_every_choice_alike():
    s = make_scheduler(SchedulerConfig(max_waiting_requests=1))
    ex = FakeExecutor(s)
    ex.submit(1, params(n_prompt=PROMPT, max_tokens=4))
    ex.handle(s.submit_choices([2, 3, 4], params(n_prompt=PROMPT, max_tokens=4), 0.0))
    assert {rid: (t.code, t.reason) for rid, t in ex.terminal.items()} == {r: (429, "queue_full") for r in (2, 3, 4)}
    assert not s._held
