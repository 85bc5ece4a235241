"""The conformance suite against a `ref` backend daemon serving two models: everything on its ipc://
endpoint (admin rights: drain/resume, load/unload of a third alias), 403 on its plain tcp:// endpoint, and
429 from a daemon whose waiting room holds two requests."""

from __future__ import annotations

import shutil

import pytest
from conformance_procs import Procs, assert_conforms, run_conformance

from workers.default_package import ensure_default_package
from workers.model_maker import make_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ref_daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(ensure_default_package(), root / "tiny")
    make_model(str(root / "small"), vocab=320, layers=1, d_model=16, heads=2, kv_heads=1, golden_cases=1,
               golden_max_tokens=2, max_seq=128, kv_num_blocks=64, name="small")
    with Procs() as procs:
        yield procs, procs.daemon(backend="ref", tcp=True, extra=["--model-root", str(root), "--model", "tiny=tiny",
                                                                  "--model", "small=small"])


def test_a_ref_daemon_with_two_models_conforms_on_its_admin_endpoint(ref_daemon, capsys):
    procs, (d, _) = ref_daemon
    code, rows, summary = run_conformance(capsys, d.endpoint, "--admin", "--second-model", "small",
                                          "--package", "small")
    assert summary["endpoint_kind"] == "daemon"
    assert_conforms(code, rows, {"error_429_overloaded", "error_403_forbidden"}, procs)


def test_its_tcp_endpoint_refuses_admin_ops_with_403(ref_daemon, capsys):
    procs, (_, tcp) = ref_daemon
    code, rows, _ = run_conformance(capsys, tcp, "--admin-denied", "--only", "error_403_forbidden,health_reply")
    assert_conforms(code, rows, set(), procs)


def test_a_burst_over_a_small_waiting_room_gets_429(capsys):
    with Procs() as procs:
        d, _ = procs.daemon(backend="ref", settings={"admission.max_waiting_requests": 2})
        code, rows, _ = run_conformance(capsys, d.endpoint, "--overload", "48", "--only", "error_429_overloaded")
        assert_conforms(code, rows, set(), procs)
