"""Alternatives and prompt logprobs from the worker's job path, against a log-softmax of the oracle's logits."""

from __future__ import annotations

import numpy as np
import pytest

from ipc.logprob_wants import want_code
from ipc.records import JobKind, JobResult, JobStatus, Lane, build_job
from workers.backends.ref import full_recompute_logits
from workers.execute_job import execute_job
from workers.model_maker import make_model
from workers.package_loader import load_package


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return load_package(make_model(str(tmp_path_factory.mktemp("pkg") / "m"), max_seq=128, kv_num_blocks=64, seed=5))


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    return z - (z.max() + np.log(np.exp(z - z.max()).sum()))


def _reference_top(z: np.ndarray, k: int) -> list[int]:
    """Ids by logit descending, ties to the lower id (a full stable sort, not the worker's partition)."""
    return sorted(range(len(z)), key=lambda i: (-float(z[i]), i))[:k]


def test_prompt_and_top_logprobs_equal_the_oracle(backend, package):
    prompt = [256] + np.random.default_rng(3).integers(0, 256, 20).tolist()
    other = [256] + np.random.default_rng(4).integers(0, 256, 9).tolist()
    oracle = full_recompute_logits(package, prompt)
    # a lane asking for its prompt's logprobs and 5 alternatives beside one that asks for nothing
    job = build_job(JobKind.PREFILL, [
        Lane(other, 0, [10]),
        Lane(prompt, 0, [0, 1], want_logprobs=want_code(True, 5, prompt=True)),
    ])
    out = execute_job(backend, job)
    assert out.status == JobStatus.OK, out.error
    res = JobResult.from_arrays(JobResult(0, 0, JobKind.PREFILL, JobStatus.OK, out.tokens, out.logprobs,
                                          **out.extra).to_arrays())
    assert res.prompt_logprobs.shape == (len(prompt) - 1,)
    for j in range(len(prompt) - 1):
        ls = _log_softmax(oracle[j])
        assert abs(res.prompt_logprobs[j] - ls[prompt[j + 1]]) < 1e-4
        assert res.prompt_top_ids[j].tolist() == _reference_top(oracle[j], 5)
        np.testing.assert_allclose(res.prompt_top_logprobs[j], ls[res.prompt_top_ids[j]], atol=1e-4)
    # the sampled token's alternatives: greedy, so the sampled token is the first and their logprobs agree
    last = _log_softmax(oracle[-1])
    assert res.top_ids[1].tolist() == _reference_top(oracle[-1], 5)
    assert res.top_ids[1, 0] == res.tokens[1]
    assert abs(res.top_logprobs[1, 0] - res.logprobs[1]) < 1e-6
    np.testing.assert_allclose(res.top_logprobs[1], last[res.top_ids[1]], atol=1e-4)
    assert res.top_ids[0].tolist() == [-1] * 5  # the lane that did not ask


def test_a_job_that_asks_nothing_has_no_extra_arrays(backend):
    job = build_job(JobKind.PREFILL, [Lane([256, 5, 6], 0, [0], want_logprobs=True)])
    out = execute_job(backend, job)
    assert out.status == JobStatus.OK and out.extra is None
