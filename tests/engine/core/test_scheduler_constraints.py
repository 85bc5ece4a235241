"""The scheduler threads a request's constraint onto its lanes: grammar + replay where it is (re)prefilled."""

from __future__ import annotations

from engine.core.constraint_spec import ConstraintSpec
from ipc.records import JobKind
from test_scheduler_fakes import FakeExecutor, make_scheduler, params

SPEC = ConstraintSpec(id=0xABCDEF, grammar="start: /[a-z]+/", kind="lark")


def _lanes(ex):
    """(job kind, constraint id, done, replay, grammar) of every job's lane 0."""
    return [(j.kind, int(j.constraint_id[0]) if j.constrained else 0,
             int(j.constraint_done[0]) if j.constrained else None,
             j.lane_replay(0).tolist() if j.constrained else None,
             j.lane_grammar(0) if j.constrained else None) for _, j in ex.jobs]


def test_prefill_carries_grammar_and_continuation_decodes_carry_the_output_count():
    s = make_scheduler(profiles=(1,))
    ex = FakeExecutor(s)
    p = params(n_prompt=6, max_tokens=5, seed=2, continuation=[7, 8], constraint=SPEC)
    ex.submit(1, p)
    ex.run()
    lanes = _lanes(ex)
    kind, cid, done, replay, grammar = lanes[0]
    assert (kind, cid, done, replay, grammar) == (JobKind.PREFILL, SPEC.id, 2, [7, 8], SPEC.grammar)
    decodes = lanes[1:]
    assert [d[2] for d in decodes] == [3, 4]  # output tokens before the sampled one (max_tokens counts the 2)
    assert all(d[0] is JobKind.DECODE and d[1] == SPEC.id and d[3] == [] and d[4] == "" for d in decodes)
    assert all(int(j.constraint_key[0]) == 1 for _, j in ex.jobs)


def test_a_requeue_after_tokens_were_emitted_replays_them():
    s = make_scheduler(chips=2, profiles=(1,))
    ex = FakeExecutor(s)
    ex.submit(1, params(max_tokens=6, seed=3, constraint=SPEC))
    ex.step(0.0)
    ex.step(0.01)
    chip = next(ch.chip for ch in s.chips.values() if ch.bound)
    ex.handle(s.on_chip_down(chip, 0.02))
    ex.run(now=0.03)
    prefills = [lane for lane in _lanes(ex) if lane[0] is JobKind.PREFILL]
    assert len(prefills) == 2 and prefills[0][3] == [] and prefills[1][4] == SPEC.grammar
    assert prefills[1][3] == ex.tokens[1][:prefills[1][2]] and prefills[1][2] >= 1


def test_unconstrained_neighbours_carry_nothing_and_jobs_without_constraints_stay_plain():
    s = make_scheduler(profiles=(1, 4))
    ex = FakeExecutor(s)
    ex.submit(1, params(seed=1, max_tokens=4, constraint=SPEC))
    ex.submit(2, params(seed=2, max_tokens=4))
    ex.submit(3, params(seed=3, max_tokens=4))
    ex.run()
    mixed = [j for _, j in ex.jobs if j.kind == JobKind.DECODE and j.constrained]
    assert mixed and all(sorted(j.constraint_id.tolist()).count(0) == j.batch - 1 for j in mixed)
    assert any(not j.constrained for _, j in ex.jobs)
