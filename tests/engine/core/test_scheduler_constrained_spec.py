"""The scheduler drafts for constrained requests (structured output): verification lanes carry the constraint
with the output count up to their real token, never counting the drafts."""

from __future__ import annotations

from engine.core.constraint_spec import ConstraintSpec
from test_scheduler_fakes import params
from test_scheduler_spec import PLAIN, SPEC, run

CONSTRAINT = ConstraintSpec(id=0xC0FFEE, grammar="start: /[a-z]+/", kind="lark")
N_PROMPT = 12


def _reqs():
    return [(1, params(n_prompt=N_PROMPT, max_tokens=40, seed=1, constraint=CONSTRAINT)),
            (2, params(n_prompt=N_PROMPT, max_tokens=40, seed=2))]


def test_constrained_requests_draft_and_their_lanes_count_only_real_tokens() -> None:
    plain, spec = run(PLAIN, _reqs()), run(SPEC, _reqs())
    assert spec.tokens == plain.tokens
    drafted = 0
    for _, job in spec.jobs:
        if not job.draft_lens.size:
            continue
        for lane in range(job.batch):
            if not job.lane_valid[lane] or not job.draft_lens[lane]:
                continue
            assert int(job.seed[lane]) in (1, 2)
            if int(job.seed[lane]) != 1:
                assert not job.constrained or job.constraint_id[lane] == 0
                continue
            drafted += 1
            start = int(job.lane_positions(lane)[0])  # the lane's real token: output count start + 1 - prompt
            assert job.constraint_id[lane] == CONSTRAINT.id and job.constraint_key[lane] == 1
            assert int(job.constraint_done[lane]) == start + 1 - N_PROMPT
            assert job.lane_grammar(lane) == "" and job.lane_replay(lane).size == 0
    assert drafted > 0
    c = spec.sched.spec.counters
    assert 0 < c.constrained_drafts < c.drafts and c.constrained_accepted_tokens > 0
    st = spec.sched.stats()["speculative"]["constrained"]
    assert st == {"num_drafts": c.constrained_drafts, "num_accepted_tokens": c.constrained_accepted_tokens}
