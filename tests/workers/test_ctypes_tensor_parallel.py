"""The C ABI's collective hook (`simpler_tp_init`) in the reference chip library: the `ctypes` backend
on 2 ranks, each computing its vocabulary slice and summing through npuserve's all-reduce, gives the
logits and tokens of one chip; a library without the hook refuses TP with a clear error."""

from __future__ import annotations

import numpy as np
import pytest

from ipc.records import JobKind, JobStatus, Lane, build_job
from workers.backends.ctypes_backend import CtypesBackend, NativeLibraryError, build_reference_library
from tools.tp_ranks import run_group

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return str(build_reference_library(tmp_path_factory.mktemp("lib")))


def scenario(info):
    rng = np.random.default_rng(3)
    a, b = rng.integers(2, 300, 40).tolist(), rng.integers(2, 300, 25).tolist()
    yield build_job(JobKind.PREFILL, [Lane(a[:30], 0, [0, 1, 2])], return_logits=True)
    yield build_job(JobKind.PREFILL, [Lane(b[:20], 0, [5, 6])], return_logits=True)
    for s in range(5):
        yield build_job(JobKind.DECODE, [Lane([a[30 + s]], 30 + s, [0, 1, 2]), None,
                                         Lane([b[20 + s]], 20 + s, [5, 6], temperature=0.9, seed=4)],
                        batch=4, return_logits=True)


def test_two_ranks_equal_one_chip(library):
    one = run_group(1, None, "tests.workers.test_ctypes_tensor_parallel:scenario", backend="ctypes",
                    options={"library": library})
    two = run_group(2, None, "tests.workers.test_ctypes_tensor_parallel:scenario", backend="ctypes",
                    options={"library": library})
    assert one.statuses == two.statuses == [int(JobStatus.OK)] * 7
    assert two.allreduce_calls >= 2 + 5 * 2  # one reduce per prefill lane and per valid decode lane
    for l1, l2, t1, t2 in zip(one.logits, two.logits, one.tokens, two.tokens):
        assert np.array_equal(l1, l2)  # slices summed with zeros: exact
        assert np.array_equal(t1, t2)


def test_tp_without_the_hook_is_refused(tmp_path, library):
    src = open(library, "rb").read()
    assert b"simpler_tp_init" in src
    with pytest.raises(ValueError, match="tp_group"):
        CtypesBackend(library=library, tp_rank=0, tp_world=2)
    old = build_reference_library(tmp_path, name="libold.so", defines={"simpler_tp_init": "vendor_private_init"})
    with pytest.raises(NativeLibraryError, match="lacks simpler_tp_init"):
        CtypesBackend(library=str(old), tp_rank=0, tp_world=2, tp_group="/x")
