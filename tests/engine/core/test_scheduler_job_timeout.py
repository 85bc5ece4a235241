"""A job timeout means a hung chip: the core takes the chip down and asks for a restart; its READY recovers the KV.

The bug this guards (Gemma, 2026-12-01): a timed-out job's KV was quarantined
and nothing ever released it, so every requeued request waited for KV forever.
"""

from __future__ import annotations

from engine.core.actions import FinishRequest
from engine.core.scheduler_config import SchedulerConfig
from test_scheduler_fakes import FakeExecutor, kv_fully_free, make_scheduler, params


def test_timed_out_job_takes_the_chip_down_and_recovery_serves_the_waiting_requests():
    # 32 blocks of 16: each 120-token prompt (+1 decode slot) takes 8 blocks, so 4 fit and 4 wait for KV
    s = make_scheduler(SchedulerConfig(job_timeout_s=1.0, max_retries=2), num_blocks=32, mixed=512)
    ex = FakeExecutor(s)
    for i in range(8):
        ex.submit(i, params(n_prompt=120, max_tokens=3, seed=i))
    ex.handle(s.tick(0.0))
    assert ex.pending and s.admission_blocked == "kv"
    ex.pending.clear()  # the chip hangs: these jobs never answer

    ex.handle(s.tick(1.0))  # past job_timeout
    assert s.stats()["counters"]["timed_out_jobs"] >= 1
    assert not ex.terminal  # the lanes are retried, not failed
    hung = [chip for event, chip, _ in s.take_notices() if event == "chip_hung"]
    ex.handle(s.tick(1.5))
    assert not ex.pending  # nothing is sent to the hung chip until its worker is back
    for chip in hung:  # what the shell does: restart the worker; its READY recovers the KV (the quarantine)
        ex.handle(s.on_chip_up(chip, 2.0))
    assert hung == [0] and s.chips[0].in_service and s.chips[0].kv.available_blocks() == 32
    ex.run(2.0, max_steps=2000)  # today's bug: the requeued requests waited for quarantined KV forever
    assert sorted(ex.terminal) == list(range(8))
    assert all(isinstance(t, FinishRequest) and t.finish_reason == "length" for t in ex.terminal.values())
    assert kv_fully_free(s)


def test_other_chip_keeps_serving_while_the_hung_one_restarts():
    s = make_scheduler(SchedulerConfig(job_timeout_s=1.0), chips=2)
    ex = FakeExecutor(s)
    ex.submit(1, params(seed=1))
    ex.handle(s.tick(0.0))
    (chip, _), = ex.pending
    ex.pending.clear()
    actions = s.tick(1.0)
    assert s.take_notices() == [("chip_hung", chip, "job_timeout")]
    ex.handle(actions)
    assert {c for c, _ in ex.pending} == {1 - chip}  # the retry runs on the other chip
    ex.run(1.0)
    assert isinstance(ex.terminal[1], FinishRequest)
    assert not s.chips[chip].in_service
    ex.handle(s.on_chip_up(chip, 2.0))
    assert kv_fully_free(s)
