"""Speculative decoding in the scheduler core: outputs equal plain decoding, token for token; KV back to baseline."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engine.core.scheduler import ChipSpec, Scheduler
from engine.core.scheduler_config import SchedulerConfig
from ipc.records import Job, JobResult, JobStatus
from test_scheduler_fakes import EOS, FakeExecutor, kv_fully_free, make_model, make_scheduler, params


def periodic_token(seed: int, position: int) -> int:
    """A repetitive "model" (period 5 + seed % 3): n-gram drafts hit after one period."""
    return 1 + (seed * 13 + position % (5 + seed % 3)) % 997


class VerifyingExecutor(FakeExecutor):
    """Plays a worker that verifies drafts: the token at position q is token_fn(seed, q), as in a plain decode."""

    def result_for(self, job: Job, status: JobStatus = JobStatus.OK) -> JobResult:
        res = super().result_for(job, status)
        if not job.draft_lens.size:
            return res
        accepted = np.zeros(job.batch, np.int32)
        lps = []
        acc_toks: list[int] = []
        for lane in range(job.batch):
            d = int(job.draft_lens[lane])
            if not d:
                continue
            toks = job.lane_tokens(lane).tolist()
            start = int(job.lane_positions(lane)[0])
            seed = int(job.seed[lane])
            if job.draft_src.size and job.draft_src[lane]:  # the fake draft model: right except every 3rd position
                toks = toks[:1] + [self.token_fn(seed, start + j) + (1 if (start + j) % 3 == 0 else 0)
                                   for j in range(1, d + 1)]
                placeholders = job.lane_tokens(lane).tolist()[1:]
                assert placeholders == [toks[0]] * d
            a = d
            for j in range(1, d + 1):
                if toks[j] != self.token_fn(seed, start + j):
                    a = j - 1
                    break
            accepted[lane] = a
            lps += [-0.25] * a
            acc_toks += toks[1:1 + a]
            res.tokens[lane] = self.token_fn(seed, start + a + 1)
        res.accepted, res.accepted_logprobs = accepted, np.asarray(lps, np.float32)
        res.accepted_tokens = np.asarray(acc_toks, np.int32)
        return res


def run(cfg: SchedulerConfig, reqs, token_fn=periodic_token, rng=None, num_blocks=512, block_size=16,
        mixed=0, draft=False) -> VerifyingExecutor:
    model = dataclasses.replace(make_model(mixed=mixed), spec_verify=True, spec_draft=draft)
    s = Scheduler(cfg, model, [ChipSpec(0, num_blocks, block_size)])
    ex = VerifyingExecutor(s, token_fn=token_fn, rng=rng)
    for rid, p in reqs:
        ex.submit(rid, p)
    ex.run()
    assert kv_fully_free(s)
    return ex


SPEC = SchedulerConfig(spec_method="ngram", spec_max_draft_tokens=4)
PLAIN = SchedulerConfig()


def reqs_mixed():
    return [(i, params(n_prompt=12, max_tokens=40, seed=i, speculative="off" if i == 2 else None))
            for i in range(4)]


@pytest.mark.parametrize("mixed", [0, 4096])
def test_greedy_outputs_equal_plain_decoding_alone_and_batched(mixed) -> None:
    plain = run(PLAIN, reqs_mixed(), mixed=mixed)
    spec = run(SPEC, reqs_mixed(), mixed=mixed)
    assert spec.tokens == plain.tokens
    assert {k: v.finish_reason for k, v in spec.terminal.items()} == {k: v.finish_reason for k, v in plain.terminal.items()}
    c = spec.sched.spec.counters
    assert c.accepted_tokens > 50 and c.drafts > 0
    alone = run(SPEC, [(0, params(n_prompt=12, max_tokens=40, seed=0))])
    alone_plain = run(PLAIN, [(0, params(n_prompt=12, max_tokens=40, seed=0))])
    assert alone.tokens[0] == plain.tokens[0]
    assert len(alone.jobs) < len(alone_plain.jobs) * 0.5  # several tokens per verification step
    # the lane that opted out never carried drafts
    for _, job in spec.jobs:
        if job.draft_lens.size:
            for lane in range(job.batch):
                if job.lane_valid[lane] and int(job.seed[lane]) == 2:
                    assert job.draft_lens[lane] == 0


def stop_token_fn(seed: int, position: int) -> int:
    return EOS if position == 12 + 17 else periodic_token(seed, position)


@pytest.mark.parametrize("case", ["eos", "stop_id", "stop_seq", "max_tokens"])
def test_stops_inside_an_accepted_run_end_exactly_where_plain_decoding_ends(case) -> None:
    kw = {}
    fn = periodic_token
    if case == "eos":
        fn = stop_token_fn
    elif case == "stop_id":
        kw = {"stop_token_ids": [periodic_token(0, 12 + 13)]}
    elif case == "stop_seq":
        kw = {"stop": [[periodic_token(0, 12 + 9), periodic_token(0, 12 + 10)]]}
    mt = 23 if case == "max_tokens" else 60
    reqs = [(0, params(n_prompt=12, max_tokens=mt, seed=0, logprobs=True, **kw))]
    plain, spec = run(PLAIN, reqs, token_fn=fn), run(SPEC, reqs, token_fn=fn)
    assert spec.tokens == plain.tokens and len(spec.tokens[0]) < 60
    assert spec.terminal[0].finish_reason == plain.terminal[0].finish_reason
    assert spec.terminal[0].usage == plain.terminal[0].usage
    assert spec.sched.spec.counters.accepted_tokens > 0


def test_large_batches_do_not_speculate() -> None:
    reqs = [(i, params(n_prompt=12, max_tokens=20, seed=i)) for i in range(8)]
    cfg = SchedulerConfig(spec_method="ngram", spec_max_batch_lanes=4)
    ex = run(cfg, reqs)
    for _, job in ex.jobs:
        if job.draft_lens.size:
            assert int(job.lane_valid.sum()) <= 4
    assert ex.tokens == run(PLAIN, reqs).tokens


def test_without_a_verifying_backend_nothing_is_drafted() -> None:
    s = make_scheduler(SPEC)
    ex = FakeExecutor(s, token_fn=periodic_token)
    ex.submit(0, params(n_prompt=12, max_tokens=30))
    ex.run()
    assert all(not job.draft_lens.size for _, job in ex.jobs) and len(ex.tokens[0]) == 30


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(2, 5))
def test_kv_accounting_returns_to_baseline_for_any_rejection_pattern(seed, k, bs) -> None:
    """A model that agrees with the n-gram drafts at random: every accept/reject pattern, small blocks, out of order."""
    rnd = random.Random(seed)
    noise = {}

    def fn(s: int, pos: int) -> int:
        if (s, pos) not in noise:
            noise[(s, pos)] = rnd.random() < 0.3
        return 500 + pos if noise[(s, pos)] else periodic_token(s, pos)

    reqs = [(i, params(n_prompt=6, max_tokens=25, seed=i)) for i in range(3)]
    cfg = SchedulerConfig(spec_method="ngram", spec_max_draft_tokens=k)
    plain = run(PLAIN, reqs, token_fn=fn, block_size=bs, num_blocks=64)
    spec = run(cfg, reqs, token_fn=fn, rng=random.Random(seed), block_size=bs, num_blocks=64)
    assert spec.tokens == plain.tokens


def free_token(seed: int, position: int) -> int:
    return 1 + (seed * 1_000_003 + position * 7_919) % 997  # nothing for an n-gram lookup to find


def test_draft_model_lanes_equal_plain_decoding_and_use_the_workers_proposals() -> None:
    reqs = [(i, params(n_prompt=10, max_tokens=30, seed=i, speculative="draft" if i < 2 else "ngram",
                       stop_token_ids=[free_token(1, 10 + 17)] if i == 1 else []))
            for i in range(3)]
    cfg = SchedulerConfig(spec_method="ngram", spec_max_draft_tokens=4)
    plain = run(PLAIN, reqs, token_fn=free_token)
    spec = run(cfg, reqs, token_fn=free_token, draft=True)
    assert spec.tokens == plain.tokens and len(spec.tokens[1]) < 30
    assert any(job.draft_src.size for _, job in spec.jobs)
    c = spec.sched.spec.counters
    assert c.accepted_tokens > 10 and c.draft_tokens > c.accepted_tokens  # drafted counts the placeholders
    # without a draft model on the board, "draft" decodes plainly
    nodraft = run(cfg, reqs[:1], token_fn=free_token)
    assert nodraft.tokens[0] == plain.tokens[0] and not any(job.draft_lens.size for _, job in nodraft.jobs)
