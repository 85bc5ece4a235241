"""A digest of every action the scheduler core returns over six random workloads: run by hand, not by pytest.

Why: a refactor of the scheduler that must not change behaviour proves it by
running this at the commit before and the commit after and comparing the
printed digests (they must be equal). It is not a test with a pinned hash: a
hash produced by the code under test proves nothing on its own, only the
before/after comparison does.

    PYTHONPATH=$PWD python tests/engine/core/action_digest.py

The workloads drive the core with a fake clock and the fake chips of the
scheduler tests (`test_scheduler_fakes.FakeExecutor`, the verifying executor
of `test_scheduler_spec`, the ref-backend board of `tier_harness`): plain
decode with faults, cancels, deadlines and a shutdown; mixed batches; queued
next steps with multi-step decode; speculative verification (n-gram and the
draft model); text with stop strings and tenants at their lane share; KV tiers.
Every action (each job's arrays included), each tick's next wake-up and the
final stats are hashed. Prints one line per workload and the total.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine.core.actions import SubmitJob  # noqa: E402
from engine.core.scheduler import ChipSpec, Scheduler  # noqa: E402
from engine.core.scheduler_config import SchedulerConfig, TenantPolicy  # noqa: E402
from test_scheduler_fakes import VOCAB, FakeExecutor, make_model, make_scheduler, params  # noqa: E402
from test_scheduler_multi_step import StepsExecutor  # noqa: E402
from test_scheduler_spec import VerifyingExecutor, periodic_token  # noqa: E402


class Digest:
    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.n = 0

    def add(self, text: str) -> None:
        self.h.update(text.encode())
        self.h.update(b"\n")

    def actions(self, actions) -> None:
        for a in actions:
            self.n += 1
            if isinstance(a, SubmitJob):
                self.add(f"job chip={a.chip} ids={a.request_ids}")
                for k, v in sorted(a.job.to_arrays().items()):
                    arr = np.ascontiguousarray(v)
                    self.add(f"{k} {arr.dtype} {arr.shape}")
                    self.h.update(arr.tobytes())
            else:
                self.add(repr(a))


def recording(ex, digest: Digest):
    """Hash every action before the executor sees it."""
    handle = ex.handle

    def h(actions):
        digest.actions(actions)
        handle(actions)

    ex.handle = h
    return ex


def bad_tokens(token_fn, rng: random.Random, rate: float):
    """A chip that now and then returns a token outside the vocabulary."""
    def fn(seed: int, pos: int) -> int:
        return VOCAB + 7 if rng.random() < rate else token_fn(seed, pos)
    return fn


def churn(sched: Scheduler, ex, digest: Digest, rng: random.Random, *, steps=400, faults=True,
          tenants=("a",), stop=None, in_order=False, rate=3) -> None:
    """Random arrivals, cancels, failed jobs, chip faults; completions in random order; then a shutdown."""
    now = 0.0
    next_id = 0
    chips = list(sched.chips)
    for step in range(steps):
        for _ in range(rng.randint(0, rate) if step < steps * 0.5 else 0):
            kw = {}
            if stop is not None and rng.random() < 0.5:
                kw["stop_strings"] = [stop]
            ex.submit(next_id, params(n_prompt=rng.randint(1, 90), max_tokens=rng.randint(1, 40), seed=next_id,
                                      deadline_ms=rng.choice([None] * 6 + [150, 3000]),
                                      tenant=rng.choice(tenants), **kw), now)
            next_id += 1
        if rng.random() < 0.2 and next_id:
            ex.handle(sched.cancel(rng.randrange(next_id), now))
        if faults and rng.random() < 0.02:
            c = rng.choice(chips)
            ex.pending = [(ch, j) for ch, j in ex.pending if ch != c]
            ex.handle(sched.on_chip_down(c, now))
            ex.handle(sched.on_chip_up(c, now))
        if faults and ex.pending and rng.random() < 0.02:
            ex.fail_jobs.add(rng.choice(ex.pending)[1].job_id)
        ex.handle(sched.tick(now))
        digest.add(f"wake {sched.next_wakeup(now)!r}")
        for _ in range(rng.randint(0, len(ex.pending))):
            ex.complete_one(now, 0 if in_order else rng.randrange(len(ex.pending)))
        now += 0.01
        if step == steps - 10:
            ex.handle(sched.shutdown(now))
    while ex.pending:
        ex.complete_one(now, 0 if in_order else rng.randrange(len(ex.pending)))
    ex.handle(sched.tick(now))
    digest.add(repr(sorted(sched.stats(now).items(), key=lambda kv: kv[0])))


def w_plain(seed: int, d: Digest) -> None:
    rng = random.Random(seed)
    s = make_scheduler(chips=2, num_blocks=48)
    ex = recording(FakeExecutor(s, rng=rng, token_fn=bad_tokens(lambda a, b: 1 + (a * 7 + b) % 997, rng, 0.002)), d)
    churn(s, ex, d, rng)


def w_mixed(seed: int, d: Digest) -> None:
    rng = random.Random(seed)
    s = make_scheduler(SchedulerConfig(max_inflight=2), chips=1, num_blocks=64, mixed=256)
    ex = recording(FakeExecutor(s, rng=rng), d)
    churn(s, ex, d, rng)


def w_queued_multistep(seed: int, d: Digest) -> None:
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_inflight=2, queue_next_step=True, decode_steps=4)
    s = make_scheduler(cfg, chips=2, num_blocks=40)
    ex = recording(StepsExecutor(s), d)  # a chip answers its jobs in order: a queued step follows its predecessor
    churn(s, ex, d, rng, in_order=True)
    s2 = make_scheduler(SchedulerConfig(decode_steps=3), chips=1, num_blocks=64, mixed=512)
    ex2 = recording(StepsExecutor(s2), d)
    churn(s2, ex2, d, rng, steps=120, faults=False, in_order=True)


def w_spec(seed: int, d: Digest) -> None:
    rng = random.Random(seed)
    for mixed, draft in ((0, False), (512, False), (0, True)):
        cfg = SchedulerConfig(spec_method="draft" if draft else "ngram", spec_max_draft_tokens=4)
        model = dataclasses.replace(make_model(mixed=mixed), spec_verify=True, spec_draft=draft)
        s = Scheduler(cfg, model, [ChipSpec(0, 64, 16)])
        ex = recording(VerifyingExecutor(s, token_fn=bad_tokens(periodic_token, rng, 0.001), rng=rng), d)
        churn(s, ex, d, rng, steps=160, rate=1)


def piece(t: int) -> bytes:
    return bytes([32 + t % 90])


def w_text_tenants(seed: int, d: Digest) -> None:
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_sequences=6, max_tenant_lane_share=0.5,
                          tenants={"b": TenantPolicy(weight=3), "c": TenantPolicy(max_active_sequences=2)})
    s = make_scheduler(cfg, chips=1, num_blocks=64, piece=piece)
    ex = recording(FakeExecutor(s, rng=rng), d)
    churn(s, ex, d, rng, tenants=("a", "b", "c"), stop="E")


def w_tiers(seed: int, d: Digest) -> None:
    from tier_harness import Board

    rng = random.Random(seed)
    board = Board(num_blocks=8, host_slots=64)
    try:
        handle = board.handle

        def h(actions):
            d.actions(actions)
            handle(actions)

        board.handle = h
        shared = [rng.randrange(1, 300) for _ in range(48)]  # 3 full blocks: evicted and imported again
        rid = 0
        for _ in range(4):
            for _ in range(rng.randint(1, 2)):
                rid += 1
                board.submit(rid, shared + [rng.randrange(1, 300) for _ in range(rng.randint(1, 12))],
                             rng.randint(1, 6), temperature=rng.choice([0.0, 0.8]), seed=rid)
            board.run()
            for _ in range(2):  # unrelated prompts that evict the shared prefix from the chip
                rid += 1
                board.submit(rid, [rng.randrange(1, 300) for _ in range(60)], rng.randint(1, 4), seed=rid)
                board.run()
        board.run()
        d.add(repr(sorted(board.sched.stats(board.now).items(), key=lambda kv: kv[0])))
    finally:
        board.close()


WORKLOADS = [w_plain, w_mixed, w_queued_multistep, w_spec, w_text_tenants, w_tiers]


def main() -> int:
    total = hashlib.sha256()
    for i, w in enumerate(WORKLOADS):
        d = Digest()
        w(1000 + i, d)
        digest = d.h.hexdigest()
        total.update(digest.encode())
        print(f"{w.__name__:22s} actions={d.n:7d} {digest}")
    print(f"{'total':22s} {total.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
