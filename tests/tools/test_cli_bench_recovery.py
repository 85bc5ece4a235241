"""`npuserve bench-recovery` end to end, tiny: 2 faults of each kind on the stub backend, fast heartbeats."""

from __future__ import annotations

import json

from tools.bench import recovery as bench_recovery


def test_two_faults_of_each_kind_give_fault_rows_and_a_summary(capsys):
    rc = bench_recovery.main(["--backend", "stub", "--faults", "2", "--json", "--heartbeat-interval-ms", "100",
                              "--heartbeat-timeout-ms", "1500", "--supervise-interval-ms", "100"])
    assert rc == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    kinds = [ln["kind"] for ln in lines]
    assert kinds == ["fault"] * 4 + ["row", "row", "summary"]
    faults, rows, summary = lines[:4], lines[4:6], lines[6]
    assert [(f["fault"], f["index"]) for f in faults] == [("kill", 0), ("kill", 1), ("stop", 0), ("stop", 1)]
    for f in faults:
        assert f["backend"] == "stub" and f["new_pid"] not in (None, f["old_pid"])
        assert 0 < f["back_s"] < bench_recovery.BACK_TIMEOUT_S and f["detect_s"] is not None
        assert abs(f["detect_s"] + f["restart_s"] - f["back_s"]) < 1e-3
    # a hung worker is found by the heartbeat: not before its timeout
    assert all(f["detect_s"] >= 1.5 - 0.05 for f in faults if f["fault"] == "stop")
    for r in rows:
        assert r["faults"] == r["recovered"] == 2 and r["target_s"] == 2.0
        assert set(r) >= {"back_p50_s", "back_max_s", "detect_p50_s", "restart_max_s", "margin_s", "met", "target"}
        assert r["back_p50_s"] <= r["back_max_s"]
    assert rows[1]["detect_bound_s"] == 1.5 + 0.1 + bench_recovery.DETECT_SLACK_S
    assert set(summary) >= {"target_s", "met", "worst_kill_back_max_s", "worst_restart_max_s"}
    assert summary["met"] == all(r["met"] for r in rows)
