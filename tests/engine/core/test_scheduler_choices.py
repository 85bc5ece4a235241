"""`n` > 1 in the scheduler: one prompt computation shared by the choices, seeded streams, cancel, fairness."""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.core.requests import RequestState
from engine.core.scheduler_config import SchedulerConfig
from engine.core.sched.choices import choice_seed
from ipc.records import JobKind
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


# ----------------------------------------------------------- forked by a device copy (ModelSpec.kv_copy)
def _copies(ex) -> list:
    return [j for _, j in ex.jobs if j.kind == JobKind.KV_COPY]


def test_with_kv_copy_n4_computes_no_prompt_token_twice_and_each_choice_is_its_seeded_n1():
    s = make_scheduler(kv_copy=True)
    ex = FakeExecutor(s)
    p = params(n_prompt=PROMPT, max_tokens=5, seed=7)
    ex.handle(s.submit_choices([10, 11, 12, 13], p, 0.0))
    ex.run()
    c = s.stats()["counters"]
    assert c["prefill_tokens"] == PROMPT  # exactly the prompt, once
    assert c["prefix_hit_tokens"] == 3 * 32 and c["choices_kv_forked"] == 3
    [copy] = _copies(ex)  # the three choices admitted together: one copy job
    assert c["choices_kv_copy_blocks"] == 3 and c["choices_kv_copy_jobs"] == 1
    assert len(set(copy.src_blocks.tolist())) == 1  # the leader's partial last block, to each choice
    assert len(set(copy.dst_blocks.tolist()) | set(copy.src_blocks.tolist())) == 4
    for k, rid in enumerate([10, 11, 12, 13]):
        assert ex.terminal[rid].finish_reason == "length"
        assert ex.tokens[rid] == _n1_tokens(p, k), k
    assert kv_fully_free(s)


def test_a_choice_decodes_the_prompts_last_token_into_the_copied_block_after_the_copy():
    s = make_scheduler(kv_copy=True)
    ex = FakeExecutor(s)
    p = params(n_prompt=PROMPT, max_tokens=3, seed=3)
    ex.handle(s.submit_choices([1, 2], p, 0.0))
    ex.run()
    order = [j for _, j in ex.jobs]
    copy = next(i for i, j in enumerate(order) if j.kind == JobKind.KV_COPY)
    dst = int(order[copy].dst_blocks[0])
    # the first job after the copy that carries a lane with the copied block: choice 2's first decode step
    first = next(j for j in order[copy + 1:] if j.kind == JobKind.DECODE and (j.block_tables[:, 2] == dst).any())
    lane = int(np.flatnonzero(first.block_tables[:, 2] == dst)[0])
    assert int(first.positions[first.query_start[lane]]) == PROMPT - 1
    assert int(first.tokens[first.query_start[lane]]) == p.prompt[-1]
    assert not any(j.kind == JobKind.PREFILL and (j.block_tables[:, 2] == dst).any() for _, j in ex.jobs)


def test_without_a_partial_block_nothing_is_copied_and_nothing_recomputed():
    s = make_scheduler(kv_copy=True)
    ex = FakeExecutor(s)
    p = params(n_prompt=33, max_tokens=4, seed=5)  # positions 0..31 in two full blocks, 32 is fed by decode
    ex.handle(s.submit_choices([1, 2, 3], p, 0.0))
    ex.run()
    c = s.stats()["counters"]
    assert c["prefill_tokens"] == 33 and not _copies(ex) and c["choices_kv_forked"] == 2
    for k, rid in enumerate([1, 2, 3]):
        assert ex.tokens[rid] == _n1_tokens(p, k), k
    assert kv_fully_free(s)


def test_without_the_prefix_cache_every_prompt_block_is_copied():
    s = make_scheduler(SchedulerConfig(prefix_cache=False), kv_copy=True)
    ex = FakeExecutor(s)
    p = params(n_prompt=PROMPT, max_tokens=4, seed=9)
    ex.handle(s.submit_choices([1, 2], p, 0.0))
    ex.run()
    assert s.stats()["counters"]["prefill_tokens"] == PROMPT
    [copy] = _copies(ex)
    assert len(copy.src_blocks) == 3 and not set(copy.src_blocks.tolist()) & set(copy.dst_blocks.tolist())
    assert ex.tokens[2] == _n1_tokens(p, 1)
    assert kv_fully_free(s)


def test_a_failed_copy_retries_the_choice_which_then_recomputes():
    s = make_scheduler(kv_copy=True)
    ex = FakeExecutor(s)
    p = params(n_prompt=PROMPT, max_tokens=4, seed=2)
    ex.handle(s.submit_choices([1, 2], p, 0.0))
    now = 0.0
    while not _copies(ex):
        ex.handle(s.tick(now))
        ex.fail_jobs.update(j.job_id for j in _copies(ex))
        ex.complete_all(now)
        now += 0.01
    ex.run(now)
    c = s.stats()["counters"]
    assert c["choices_kv_copy_failed"] == 1 and c["requeued"] == 1
    assert ex.tokens[2] == _n1_tokens(p, 1) and ex.terminal[2].finish_reason == "length"
    assert not s.has_work() and not s.chips[0].kv.seq_ids()  # its blocks: quarantined, as any failed job's


def test_a_choice_cancelled_while_its_copy_runs_gives_its_blocks_back_and_the_others_go_on():
    s = make_scheduler(kv_copy=True)
    ex = FakeExecutor(s)
    p = params(n_prompt=PROMPT, max_tokens=6, seed=4)
    ex.handle(s.submit_choices([1, 2, 3], p, 0.0))
    ex.step(0.0)  # the leader's prompt
    ex.handle(s.tick(0.01))  # choices 2 and 3 admitted: their copy goes out, one job
    assert [j.kind for _, j in ex.pending].count(JobKind.KV_COPY) == 1
    ex.handle(s.cancel(2, 0.01))
    ex.run(0.02)
    assert ex.terminal[2].finish_reason == "cancelled" and ex.terminal[2].usage["completion_tokens"] == 0
    assert ex.tokens[3] == _n1_tokens(p, 2) and ex.tokens[1] == _n1_tokens(p, 0)
    assert not s.has_work() and kv_fully_free(s)
