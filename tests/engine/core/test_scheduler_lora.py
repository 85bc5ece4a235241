"""Jobs and LoRA adapters in the scheduler core: each lane names its request's adapter, and no job names more
adapters than the chip holds in device slots (the lanes past it wait, none starves). Fake executor, no clock."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from engine.core.actions import FinishRequest, SubmitJob
from engine.core.scheduler import ChipSpec, ModelSpec, Scheduler
from engine.core.scheduler_config import SchedulerConfig
from ipc.records import JobKind
from tests.engine.core.test_scheduler_fakes import EOS, VOCAB, FakeExecutor, params


class LaneRecorder(FakeExecutor):
    """Also keeps each job's lanes (request ids, in lane order)."""

    def __init__(self, sched) -> None:
        super().__init__(sched)
        self.lanes: list[tuple[object, list[int]]] = []

    def handle(self, actions) -> None:
        self.lanes += [(a.job, list(a.request_ids)) for a in actions if isinstance(a, SubmitJob)]
        super().handle(actions)


def _sched(slots: int, mixed: int) -> Scheduler:
    model = ModelSpec(generation=1, vocab_size=VOCAB, eos_ids=(EOS,), max_seq=2048, profiles=(1, 4, 8, 16),
                      chunked_prefill=True, mixed_batch_tokens=mixed, lora_slots=slots)
    return Scheduler(SchedulerConfig(), model, [ChipSpec(0, 512, 16)])


@pytest.mark.parametrize("mixed", [0, 512], ids=["separate", "mixed"])
def test_no_job_names_more_adapters_than_slots_and_every_request_finishes(mixed):
    ex = LaneRecorder(_sched(2, mixed))
    adapters = {rid: [-1, 0, 1, 2, 3][rid % 5] for rid in range(30)}
    for rid, a in adapters.items():
        ex.submit(rid, params(n_prompt=5 + rid, max_tokens=8, seed=rid, adapter=a))
    ex.run()
    assert len(ex.terminal) == 30 and all(isinstance(t, FinishRequest) for t in ex.terminal.values())
    assert all(len(ex.tokens[rid]) == 8 for rid in adapters)
    per_job = Counter()
    for job, lanes in ex.lanes:
        if job.kind not in (JobKind.PREFILL, JobKind.DECODE):
            continue
        if all(adapters[r] < 0 for r in lanes):
            assert job.adapter.size == 0  # a base-only job carries no adapter field
            continue
        assert job.adapter.tolist()[:len(lanes)] == [adapters[r] for r in lanes]
        assert all(x == -1 for x in job.adapter.tolist()[len(lanes):])
        used = {adapters[r] for r in lanes} - {-1}
        assert len(used) <= 2, (job.job_id, used)
        per_job[len(used)] += 1
    assert per_job[2] > 0  # lanes of different adapters do share jobs (the ref backend's per-lane product)


def test_without_adapter_slots_jobs_carry_no_adapter_field():
    ex = LaneRecorder(_sched(0, 0))
    for rid in range(4):
        ex.submit(rid, params(max_tokens=3, seed=rid))
    ex.run()
    assert all(job.adapter.size == 0 for job, _ in ex.lanes)


def test_the_adapter_field_survives_the_record_round_trip():
    ex = LaneRecorder(_sched(4, 0))
    for rid in range(6):
        ex.submit(rid, params(max_tokens=2, seed=rid, adapter=rid % 3 - 1))
    ex.run()
    from ipc.records import Job
    for job, lanes in ex.lanes:
        back = Job.from_arrays(job.to_arrays())
        assert np.array_equal(back.adapter, job.adapter)


# ---- one adapter per job (llama.cpp): jobs grouped by adapter, with a bounded wait --------------------------

def _grouped(mixed: int) -> Scheduler:
    model = ModelSpec(generation=1, vocab_size=VOCAB, eos_ids=(EOS,), max_seq=2048, profiles=(1, 4, 8, 16),
                      chunked_prefill=True, mixed_batch_tokens=mixed, lora_slots=8, lora_mixed=False)
    return Scheduler(SchedulerConfig(), model, [ChipSpec(0, 512, 16)])


@pytest.mark.parametrize("mixed", [0, 512], ids=["separate", "mixed"])
def test_grouped_jobs_run_one_adapter_each_and_every_request_finishes(mixed):
    ex = LaneRecorder(_grouped(mixed))
    adapters = {rid: [-1, 0, 1, 2][rid % 4] for rid in range(24)}
    for rid, a in adapters.items():
        ex.submit(rid, params(n_prompt=4 + rid, max_tokens=6, seed=rid, adapter=a))
    ex.run()
    assert len(ex.terminal) == 24 and all(len(ex.tokens[rid]) == 6 for rid in adapters)
    groups = Counter()
    for job, lanes in ex.lanes:
        if job.kind in (JobKind.PREFILL, JobKind.DECODE):
            assert len({adapters[r] for r in lanes}) == 1, [adapters[r] for r in lanes]
            groups[adapters[lanes[0]]] += 1
    assert set(groups) == {-1, 0, 1, 2}


def test_a_prompt_of_another_adapter_waits_a_bounded_number_of_jobs_behind_busy_decode_lanes():
    """Mixed jobs put decode lanes first, so an adapter whose streams keep decoding would hold every job;
    the waiting adapter's prompt is forced in after MAX_WAIT_JOBS jobs."""
    from engine.core.lora.adapter_groups import MAX_WAIT_JOBS

    sched = _grouped(512)
    ex = LaneRecorder(sched)
    for rid in range(6):
        ex.submit(rid, params(n_prompt=6, max_tokens=200, seed=rid, adapter=0))
    now = 0.0
    for _ in range(3):  # the six are decoding
        ex.step(now)
        now += 0.01
    seen_before = len(ex.lanes)
    ex.submit(99, params(n_prompt=6, max_tokens=2, seed=99, adapter=1))
    while 99 not in ex.tokens:
        ex.step(now)
        now += 0.01
        assert len(ex.lanes) - seen_before < 50, "adapter 1 starved"
    waited = next(i for i, (_, lanes) in enumerate(ex.lanes[seen_before:]) if 99 in lanes)
    assert waited <= MAX_WAIT_JOBS
