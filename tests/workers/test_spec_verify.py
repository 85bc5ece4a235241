"""Speculative verification in the worker: draft rows from the ref backend, acceptance, exactness when sampled."""

from __future__ import annotations

import numpy as np
import pytest

from ipc.records import Job, JobKind, JobResult, JobStatus, Lane, build_job
from workers.backends.ref import RefBackend, full_recompute_logits
from workers.execute_job import execute_job
from workers.model_maker import make_model
from workers.package_loader import load_package
from workers.sampling import sample
from workers.spec_verify import draft_rows, verify_drafts

TOL = 1e-4
CHI2_DF4_P001 = 18.467  # chi-square critical value, 4 degrees of freedom, false-failure rate 1e-3


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("pkg") / "m"), max_seq=128, kv_num_blocks=64, seed=5)
    return load_package(path)


def _seq(seed: int, n: int) -> list[int]:
    return [256] + np.random.default_rng(seed).integers(0, 256, n - 1).tolist()


def test_job_with_drafts_round_trips_and_validates() -> None:
    job = build_job(JobKind.PREFILL, [Lane([1, 2, 3], 4, [0], drafts=2), Lane([5], 9, [1])], job_id=3)
    back = Job.from_arrays(job.to_arrays())
    assert back.draft_lens.tolist() == [2, 0] and back.tokens.tolist() == [1, 2, 3, 5]
    assert draft_rows(back).tolist() == [0, 1]
    back.validate()
    plain = Job.from_arrays(build_job(JobKind.DECODE, [Lane([1], 4, [0])]).to_arrays())
    assert plain.draft_lens.size == 0 and draft_rows(plain).size == 0
    job.draft_lens[0] = 3  # as many drafts as tokens: no real token left
    with pytest.raises(ValueError):
        job.validate()
    res = JobResult(1, 0, JobKind.PREFILL, JobStatus.OK, np.array([4, 5]), np.zeros(2), accepted=np.array([2, 0]),
                    accepted_logprobs=np.array([-0.5, -0.25]))
    back_res = JobResult.from_arrays(res.to_arrays())
    assert back_res.accepted.tolist() == [2, 0] and back_res.accepted_logprobs.tolist() == [-0.5, -0.25]


def test_ref_draft_rows_equal_the_oracle_in_a_batch(backend, package) -> None:
    a, b = _seq(1, 30), _seq(2, 20)
    backend.prefill(build_job(JobKind.PREFILL, [Lane(a[:25], 0, [0, 1])]))
    backend.prefill(build_job(JobKind.PREFILL, [Lane(b[:19], 0, [2, 3])]))
    job = build_job(JobKind.PREFILL, [Lane(b[19:20], 19, [2, 3]), Lane(a[25:30], 25, [0, 1], drafts=4)])
    out = backend.prefill(job)
    oa, ob = full_recompute_logits(package, a), full_recompute_logits(package, b)
    assert np.abs(out.logits[0] - ob[19]).max() <= TOL and np.abs(out.logits[1] - oa[29]).max() <= TOL
    assert np.abs(out.draft_logits - oa[25:29]).max() <= TOL


@pytest.mark.parametrize("right", [0, 2, 4])
def test_greedy_accepts_the_matching_prefix_plus_the_next_token(backend, package, right) -> None:
    seq = _seq(3, 20)
    backend.prefill(build_job(JobKind.PREFILL, [Lane(seq, 0, [0, 1])]))
    # the greedy continuation from the oracle
    cont = list(seq)
    for _ in range(5):
        cont.append(int(full_recompute_logits(package, cont)[-1].argmax()))
    greedy = cont[20:]
    drafts = greedy[:right] + [(t + 1) % 256 for t in greedy[right:4]]
    # the last real token is the sequence's last one: positions 19 (re-written) .. 23
    job = build_job(JobKind.PREFILL, [Lane([seq[-1]] + drafts, 19, [0, 1], drafts=4)])
    res = execute_job(backend, job)
    assert res.status is JobStatus.OK and res.accepted.tolist() == [right]
    assert int(res.tokens[0]) == greedy[right]


def test_a_backend_without_draft_rows_fails_the_job_not_silently() -> None:
    class NoRows(RefBackend):
        def _run(self, job):
            out = super()._run(job)
            out.draft_logits = None
            return out

    b = NoRows()
    b.load(None)
    res = execute_job(b, build_job(JobKind.PREFILL, [Lane([1, 2, 3], 0, [0], drafts=2)]))
    assert res.status is JobStatus.FAILED


def _lane_job(v: int, d: int, drafts: list[int], temperature: float, seed: int) -> Job:
    job = build_job(JobKind.PREFILL, [Lane([0] + drafts, 10, [0], temperature=temperature, seed=seed, drafts=d)])
    return job


def test_sampled_verification_is_the_plain_sample_whatever_the_draft() -> None:
    """Per (seed, position) the emitted tokens equal sampling each position without speculation."""
    rng = np.random.default_rng(0)
    v, d = 6, 3
    rows = rng.normal(size=(d, v)).astype(np.float32)
    last = rng.normal(size=(1, v)).astype(np.float32)
    for seed in range(200):
        drafts = rng.integers(0, v, d).tolist()
        job = _lane_job(v, d, drafts, 0.8, seed)
        tok, lp = sample(last, job.temperature, job.top_p, job.top_k, job.seed, job.context_lens)
        acc, _, _ = verify_drafts(job, rows, tok, lp)
        plain = sample(rows, np.full(d, 0.8), np.ones(d), np.zeros(d, int), np.full(d, seed), np.arange(11, 14))[0]
        a = int(acc[0])
        assert drafts[:a] == plain[:a].tolist()
        assert a == d or int(tok[0]) == int(plain[a])


def test_sampled_distribution_matches_the_target_chi_square() -> None:
    """First emitted token over 4000 seeds, a point-mass draft on the likeliest token vs the target's softmax.

    Fixed seeds, so the test is deterministic; the threshold p < 1e-3 is the
    false-failure rate a fresh set of seeds would have.
    """
    v = 5
    z = np.array([[1.5, 0.5, 0.0, -0.5, -1.0]], np.float32)
    p = np.exp(z[0] - z[0].max())
    p /= p.sum()
    counts = np.zeros(v)
    for seed in range(4000):
        job = _lane_job(v, 1, [0], 1.0, seed)
        tok, lp = np.array([-1], np.int32), np.zeros(1, np.float32)
        acc, _, _ = verify_drafts(job, z, tok, lp)
        counts[0 if acc[0] else int(tok[0])] += 1
    expected = p * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < CHI2_DF4_P001, (stat, counts, expected)
