"""The conformance suite against a daemon that keeps its chip busy: two jobs in flight per chip
(`executor.max_inflight = 2`), the next step queued behind the running one (`executor.queue_next_step`) and
multi-step decode jobs (`executor.decode_steps = 4`) -- the set-up where events are most likely to be
coalesced, and where cancels and stops land in the middle of a job."""

from __future__ import annotations

import pytest
from conformance_procs import Procs, assert_conforms, run_conformance

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def busy_daemon():
    with Procs() as procs:
        d, _ = procs.daemon(backend="ref", settings={"executor.max_inflight": 2, "executor.queue_next_step": True,
                                                     "executor.decode_steps": 4})
        yield procs, d


def test_a_daemon_with_two_jobs_in_flight_queued_steps_and_multi_step_decode_conforms(busy_daemon, capsys):
    procs, d = busy_daemon
    code, rows, _ = run_conformance(capsys, d.endpoint, "--admin")
    assert_conforms(code, rows, {"second_model", "error_429_overloaded", "error_403_forbidden", "model_lifecycle"},
                    procs)
