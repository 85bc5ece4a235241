"""The conformance suite against a tensor-parallel replica: a `ref` daemon with two chips as one replica
(`board.chips_per_replica = 2`), on its ipc:// endpoint (admin rights)."""

from __future__ import annotations

import pytest
from conformance_procs import Procs, assert_conforms, run_conformance

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def replica():
    with Procs() as procs:
        d, _ = procs.daemon(backend="ref", chips=2, settings={"board.chips_per_replica": 2})
        yield procs, d


def test_a_tensor_parallel_replica_conforms(replica, capsys):
    procs, d = replica
    (chip,) = d.health()["chips"]
    assert len(chip["pids"]) == 2  # one replica of two ranks, as set up
    code, rows, _ = run_conformance(capsys, d.endpoint, "--admin")
    assert_conforms(code, rows, {"second_model", "error_429_overloaded", "error_403_forbidden", "model_lifecycle"},
                    procs)
