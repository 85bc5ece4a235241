"""1,000 requests, random cancels, deadlines, a chip fault and a shutdown, completions in random order:
one terminal event each, the tokens a fault-free run gives, and every KV block back."""

from __future__ import annotations

import random

import pytest

from engine.core.actions import FailRequest, FinishRequest
from engine.core.scheduler_config import SchedulerConfig
from test_scheduler_fakes import FakeExecutor, default_token, kv_fully_free, make_scheduler, params


@pytest.mark.parametrize("seed, mixed", [(1, 0), (2, 0), (3, 256)])  # 256: mixed batches (decode + prompt chunks)
def test_thousand_requests_random_cancel_deadline_fault_shutdown(seed, mixed):
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_sequences=48, max_inflight=3, max_waiting_requests=2000,
                          max_waiting_prompt_tokens=10**7, prefill_chunk_tokens=32, job_timeout_s=5.0)
    s = make_scheduler(cfg, chips=2, num_blocks=160, block_size=16, mixed=mixed)  # small pools: preemption happens
    ex = FakeExecutor(s, rng=rng)
    accepted: set[int] = set()
    submitted = {}
    now, next_id = 0.0, 0
    shutdown_at = rng.randint(250, 350)
    for step in range(400):
        now += 0.005
        for _ in range(rng.randint(0, 6)):
            if next_id >= 1000:
                break
            p = params(n_prompt=rng.randint(1, 120), max_tokens=rng.randint(1, 60), seed=next_id,
                       deadline_ms=rng.choice([None, None, 50, 300]))
            submitted[next_id] = p
            before = len(ex.terminal)
            ex.submit(next_id, p, now)
            if not (len(ex.terminal) > before and isinstance(ex.terminal[next_id], FailRequest)):
                accepted.add(next_id)
            next_id += 1
        if rng.random() < 0.3 and next_id:
            ex.handle(s.cancel(rng.randrange(next_id), now))
        if step == 150:
            ex.handle(s.on_chip_down(1, now))
            ex.pending = [(c, j) for c, j in ex.pending if c != 1]  # its worker died with them
        if step == 200:
            ex.handle(s.on_chip_up(1, now))
        if step == shutdown_at:
            ex.handle(s.shutdown(now))
        ex.handle(s.tick(now))
        # answer a random subset of the jobs in flight, in random order
        for _ in range(rng.randint(0, len(ex.pending))):
            ex.complete_one(now, rng.randrange(len(ex.pending)))
        for ch in s.chips.values():
            ch.kv.check_invariants()
    ex.complete_all(now)
    ex.handle(s.tick(now + 1.0))
    assert next_id == 1000
    assert set(ex.terminal) == set(range(1000))  # exactly one terminal each (FakeExecutor asserts no second)
    # Token values, not only counts: whatever a request streamed despite random
    # completion order, the chip fault and preemption is exactly what the run
    # without faults gives (a seeded token is a function of seed and position).
    for rid, t in ex.terminal.items():
        p = submitted[rid]
        got = ex.tokens.get(rid, [])
        fault_free = [default_token(p.seed, pos) for pos in range(len(p.prompt), len(p.prompt) + p.max_tokens)]
        assert got == fault_free[:len(got)], rid
        if rid not in accepted:
            assert got == [] and t.code in (400, 429, 503), (rid, t)
        elif isinstance(t, FinishRequest) and t.finish_reason == "length":
            assert got == fault_free and t.usage["completion_tokens"] == p.max_tokens, rid
        elif isinstance(t, FinishRequest):
            assert t.finish_reason == "cancelled" and t.usage["completion_tokens"] == len(got), (rid, t)
    assert len(accepted) > 500  # the rest came after the shutdown (503 at once)
    assert not s.has_work()
    assert kv_fully_free(s)
    c = s.stats()["counters"]
    assert c["finished_length"] > 50 and c["cancelled"] > 10 and c["failed_shutdown"] > 0
    assert c["preemptions"] > 0 and c.get("failed_deadline_exceeded", 0) > 0
