"""The conformance suite against a `ref` backend daemon: everything on its ipc:// endpoint (admin rights),
403 on its plain tcp:// endpoint, and 429 from a daemon whose waiting room holds two requests."""

from __future__ import annotations

import pytest
from conformance_procs import Procs, assert_conforms, run_conformance

pytestmark = pytest.mark.integration

NOT_OFFERED = {"second_model", "error_429_overloaded", "error_403_forbidden"}


@pytest.fixture(scope="module")
def ref_daemon():
    procs = Procs()
    try:
        yield procs, procs.daemon(backend="ref", tcp=True)
    finally:
        problems = procs.close()
        assert not problems, "\n".join(problems)


def test_a_ref_daemon_conforms_on_its_admin_endpoint(ref_daemon, capsys):
    procs, (d, _) = ref_daemon
    code, rows, summary = run_conformance(capsys, d.endpoint, "--admin")
    assert summary["endpoint_kind"] == "daemon"
    assert_conforms(code, rows, NOT_OFFERED, procs)


def test_its_tcp_endpoint_refuses_admin_ops_with_403(ref_daemon, capsys):
    procs, (_, tcp) = ref_daemon
    code, rows, _ = run_conformance(capsys, tcp, "--admin-denied", "--only", "error_403_forbidden,health_reply")
    assert_conforms(code, rows, set(), procs)


def test_a_burst_over_a_small_waiting_room_gets_429(capsys):
    procs = Procs()
    try:
        d, _ = procs.daemon(backend="ref", settings={"admission.max_waiting_requests": 2})
        code, rows, _ = run_conformance(capsys, d.endpoint, "--overload", "48", "--only", "error_429_overloaded")
        assert_conforms(code, rows, set(), procs)
    finally:
        problems = procs.close()
        assert not problems, "\n".join(problems)
