"""The conformance suite against a balancer in front of two `ref` boards (round-robin), on its tcp://
endpoint: no admin rights there, so admin ops must get 403."""

from __future__ import annotations

import pytest
from conformance_procs import Procs, assert_conforms, run_conformance

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def balanced():
    with Procs() as procs:
        eps = [procs.daemon(backend="ref", tcp=True)[1] for _ in range(2)]
        yield procs, procs.balancer(eps)


def test_a_balancer_before_two_boards_conforms(balanced, capsys):
    procs, bal = balanced
    code, rows, summary = run_conformance(capsys, bal.endpoint, "--admin-denied")
    assert summary["endpoint_kind"] == "balancer"
    assert_conforms(code, rows, {"second_model", "error_429_overloaded", "drain_resume", "model_lifecycle"}, procs)
