"""Multi-step decode on the worker (executor.decode_steps): n steps in one job equal n one-step jobs."""

from __future__ import annotations

import numpy as np
import pytest

from ipc.records import JobKind, JobStatus, Lane, build_job
from workers.backends.ctypes_backend import CtypesBackend, build_reference_library
from workers.backends.ref import RefBackend
from workers.execute_job import execute_job
from workers.model_maker import make_model
from workers.package_loader import load_package

BS = 16
PROMPTS = ([256, 5, 9, 200, 17, 33, 41], [256, 99, 3, 7, 7, 120, 64, 1, 2, 250, 11])
TABLES = ([3, 17, 8], [21, 4, 30])


@pytest.fixture(scope="module", params=["ref", "ctypes"])
def make(request, tmp_path_factory):
    """A factory of fresh backends of one kind (the ref model / the reference chip library built once)."""
    if request.param == "ref":
        pkg = load_package(make_model(str(tmp_path_factory.mktemp("pkg") / "m"), max_seq=256, kv_num_blocks=64,
                                      seed=5))

        def ref():
            b = RefBackend()
            b.load(pkg)
            return b
        return ref
    lib = str(build_reference_library(tmp_path_factory.mktemp("lib")))

    def ctypes_chip():
        b = CtypesBackend(library=lib, chip_id=0, block_size=BS, num_blocks=64)
        b.load(None)
        return b
    return ctypes_chip


def _prefilled(make):
    b = make()
    lanes = [Lane(p, 0, t, temperature=temp, seed=seed) for p, t, temp, seed in
             zip(PROMPTS, TABLES, (0.0, 0.9), (1, 2))]
    first = execute_job(b, build_job(JobKind.PREFILL, lanes, batch=2, table_width=4))
    assert first.status == JobStatus.OK
    return b, [int(t) for t in first.tokens]


@pytest.mark.parametrize("n", [4, 8])
def test_n_steps_in_one_job_equal_n_one_step_jobs(make, n: int) -> None:
    one, toks = _prefilled(make)
    expected = [[t] for t in toks]
    for k in range(n):  # one job per step, as with decode_steps = 1
        lanes = [Lane([expected[i][-1]], len(PROMPTS[i]) + k, TABLES[i], temperature=(0.0, 0.9)[i], seed=i + 1)
                 for i in range(2)]
        out = execute_job(one, build_job(JobKind.DECODE, lanes, batch=2, table_width=4))
        for i in range(2):
            expected[i].append(int(out.tokens[i]))
    many, toks2 = _prefilled(make)
    assert toks2 == toks
    lanes = [Lane([toks[i]], len(PROMPTS[i]), TABLES[i], temperature=(0.0, 0.9)[i], seed=i + 1) for i in range(2)]
    out = execute_job(many, build_job(JobKind.DECODE, lanes, batch=2, table_width=4, decode_steps=n))
    assert out.status == JobStatus.OK and out.tokens.shape == (2, n) and out.logprobs.shape == (2, n)
    assert out.tokens.tolist() == [e[1:] for e in expected]


def test_the_step_count_travels_in_the_job_record() -> None:
    from ipc.records import Job

    job = build_job(JobKind.DECODE, [Lane([1], 3, [0])], batch=1, table_width=1, decode_steps=6)
    assert Job.from_arrays(job.to_arrays()).decode_steps == 6
    assert Job.from_arrays(build_job(JobKind.DECODE, [Lane([1], 3, [0])]).to_arrays()).decode_steps == 1
    assert np.array_equal(Job.from_arrays(job.to_arrays()).tokens, job.tokens)
