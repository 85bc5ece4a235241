"""Speculation chooses k from the measured cost of a verification step (fake clock, fake chip times)."""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.core.scheduler import ChipSpec, Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.core.spec.cost_k import CostK, best_k, expected_tokens
from engine.core.spec.step_cost import StepCost, decode_shape
from ipc.records import Job, JobResult, JobStatus
from test_scheduler_fakes import kv_fully_free, make_model, params
from test_scheduler_spec import VerifyingExecutor, periodic_token


def test_expected_tokens_and_the_best_k_per_unit_of_cost() -> None:
    assert expected_tokens(0.5, 0) == 1.0 and expected_tokens(0.5, 2) == 1.75 and expected_tokens(1.0, 3) == 4.0
    cheap = lambda k: 1.0 + 0.05 * k  # noqa: E731  a chip where a step is the weights' pass
    assert best_k(0.9, 8, cheap) == 8
    # a CPU where the LM head is most of a step: each draft costs 0.8 steps. At a = 0.9, k = 1 yields 1.9
    # tokens for 1.8 steps (1.056), k = 2 2.71 for 2.6 (1.042): one draft is the best
    dear = lambda k: 1.0 + 0.8 * k  # noqa: E731
    assert best_k(0.9, 8, dear) == 1
    assert best_k(0.7, 8, dear) == 0  # 1.7 tokens for 1.8 steps: plain decoding wins
    assert best_k(0.0, 8, cheap) == 0


def test_step_cost_is_the_slope_of_measured_means_over_the_plain_step() -> None:
    c = StepCost(prior_per_draft=0.1)
    assert c.cost(4) == 1.4  # nothing measured: the prior
    for _ in range(3):
        c.observe(1, 0, 10_000)
        c.observe(1, 4, 18_000)
        c.observe(2, 0, 12_000)
    assert c.per_draft(1) == 0.2 and c.cost(3, lanes=1) == 1.6
    assert c.per_draft(2) == 0.2  # no verification of 2 lanes measured: the nearest lane count's slope
    t = c.table(lanes=1, max_k=4)
    assert t["cost_in_steps"] == {"1": None, "2": None, "3": None, "4": 1.8} and t["plain_step_us"] == 10_000


def test_decode_shape_keeps_only_one_step_jobs_of_decode_lanes() -> None:
    assert decode_shape(2, [10, 20], [13, 21], [[1, 2], []], 1) == (2, 2)
    assert decode_shape(2, [10, 0], [11, 64], None, 1) is None  # a prompt chunk rides along
    assert decode_shape(1, [10], [14], None, 4) is None  # multi-step


def test_a_lane_stops_drafting_when_its_drafts_miss_and_probes_again() -> None:
    k = CostK(max_k=4)
    cost = lambda n: 1.0 + 0.3 * n  # noqa: E731
    assert k.next_k(cost) > 0  # the prior acceptance tries drafting
    for _ in range(6):
        k.observe(2, 0)
    assert k.next_k(cost) == 0
    ks = [k.next_k(cost) for _ in range(2)]
    assert ks == [0, 1]  # the back-off's last step probes one draft


class TimedExecutor(VerifyingExecutor):
    """A verifying chip whose backend time per job is `step_us` per lane plus `draft_us` per draft token."""

    step_us: int = 10_000
    draft_us: int = 0

    def result_for(self, job: Job, status: JobStatus = JobStatus.OK) -> JobResult:
        res = super().result_for(job, status)
        lanes = int(job.lane_valid.sum())
        drafts = int(job.draft_lens.sum()) if job.draft_lens.size else 0
        return dataclasses.replace(res, device_us=self.step_us * lanes + self.draft_us * drafts)


def noisy_token(seed: int, position: int) -> int:
    """The periodic "model", but about one position in four is off the pattern: drafts of a run of k are
    all accepted with probability about 0.75^k."""
    if (position * 2_654_435_761 + seed) % 97 < 24:
        return 500 + position % 400
    return periodic_token(seed, position)


def _run(draft_us: int, k_choice: str = "cost") -> TimedExecutor:
    cfg = SchedulerConfig(spec_method="ngram", spec_max_draft_tokens=8, spec_k_choice=k_choice)
    s = Scheduler(cfg, dataclasses.replace(make_model(), spec_verify=True), [ChipSpec(0, 512, 16)])
    ex = TimedExecutor(s, token_fn=noisy_token)
    ex.draft_us = draft_us
    ex.submit(0, params(n_prompt=12, max_tokens=300, seed=0))
    ex.run()
    assert kv_fully_free(s) and len(ex.tokens[0]) == 300
    return ex


def _drafts_per_step(ex: TimedExecutor) -> float:
    lens = [int(j.draft_lens.sum()) if j.draft_lens.size else 0 for _, j in ex.jobs]
    return float(np.mean(lens[len(lens) // 2:]))  # once the cost is measured


def _device_us(ex: TimedExecutor) -> int:
    """The fake chip's busy time over the run: what tokens/s follows on a chip that is never idle."""
    return sum(ex.step_us * int(j.lane_valid.sum()) + ex.draft_us * (int(j.draft_lens.sum()) if j.draft_lens.size
                                                                     else 0) for _, j in ex.jobs)


def test_k_from_the_measured_cost_beats_the_fixed_schedule_cheap_or_dear() -> None:
    plain_us = 300 * TimedExecutor.step_us  # one plain step per token
    cheap, cheap_sched = _run(draft_us=500), _run(draft_us=500, k_choice="adaptive")  # a draft: 0.05 steps
    dear, dear_sched = _run(draft_us=9_000), _run(draft_us=9_000, k_choice="adaptive")  # a draft: 0.9 steps
    assert cheap.sched.stats()["speculative"]["step_cost"]["per_draft"] == 0.05
    assert dear.sched.stats()["speculative"]["step_cost"]["per_draft"] == 0.9
    assert cheap.tokens == dear.tokens == cheap_sched.tokens  # the same output, whatever k
    # cheap drafts pay: drafting more than the schedule does saves chip time
    assert _device_us(cheap) < 0.95 * _device_us(cheap_sched) and _device_us(cheap) < 0.75 * plain_us
    assert _drafts_per_step(cheap) > _drafts_per_step(cheap_sched)
    # dear drafts barely pay at this acceptance: the lane mostly decodes plainly, near plain decoding's cost
    assert _drafts_per_step(dear) < 0.5 < _drafts_per_step(dear_sched)
    assert _device_us(dear) < 0.85 * _device_us(dear_sched) and _device_us(dear) < 1.1 * plain_us
