"""`npuserve chaos`: every scenario once, with its invariant checks as the assertions; the CLI's JSON rows."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT
from tools.chaos.main import SCENARIOS, run_one

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_passes(name):
    res = run_one(name)
    assert res.passed, (res.problems, {k: v for k, v in res.details.items() if k != "daemon_log_tail"},
                        res.details.get("daemon_log_tail", ""))
    assert res.requests > 0 and res.faults > 0
    assert res.recovery_s is not None  # it recovered within the scenario's own (generous) limit
    if name in ("worker-kill", "worker-kill-inflight", "worker-stop", "backend-raises"):
        assert set(res.details["terminal"]) <= {"done:length", "error:500"}
    if name == "worker-kill-inflight":  # the kill met two jobs and a queued step; lanes without a token requeued
        assert res.details["at_kill"]["inflight"] >= 3 and res.details["at_kill"]["queued_steps_inflight"] >= 1
        assert res.details["requeued"] > 0 and res.details["kv_blocks_after"]["free"] == \
            res.details["kv_blocks_after"]["total"]
    if name == "daemon-kill":  # broken streams migrated (done) or one retryable 503; dead backend out, then back
        assert set(res.details["terminal"]) <= {"done:length", "error:503"}
        assert res.details["inflight_on_killed"] > 0 and res.details["out_reason"]
        assert res.details["state_after"] in ("up", "half_open") and len(res.details["killed_pids"]) == 2


def test_cli_json_rows_and_exit_status():
    p = subprocess.run([sys.executable, "-m", "tools.cli", "chaos", "--scenario", "backend-raises", "--json"],
                       cwd=ROOT, capture_output=True, timeout=180)
    rows = [orjson.loads(line) for line in p.stdout.splitlines()]
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert len(rows) == 1
    row = rows[0]
    assert set(row) == {"kind", "scenario", "passed", "requests", "faults", "recovery_s", "details"}
    assert row["kind"] == "scenario" and row["scenario"] == "backend-raises" and row["passed"] is True
    p = subprocess.run([sys.executable, "-m", "tools.cli", "chaos", "--scenario", "no-such"], cwd=ROOT,
                       capture_output=True, timeout=60)
    assert p.returncode == 2 and b"worker-kill" in p.stderr


def test_a_failing_scenario_fails_the_command(monkeypatch, capsys):
    from tools.chaos import main as chaos_main

    def broken(res):
        res.requests, res.faults = 1, 1
        res.fail("injected: a request got two terminal events")

    monkeypatch.setitem(chaos_main.SCENARIOS, "broken", broken)
    assert chaos_main.main(["--scenario", "broken", "--json"]) == 1
    row = orjson.loads(capsys.readouterr().out)
    assert row["passed"] is False and "two terminal events" in row["details"]["problems"][0]
