"""`npuserve soak --switch-every --fault-every`: a short switching soak of a real 2-chip ref daemon.

Rounds are counts of finished requests, and the run ends after its fourth
switch, so it is the same run on a fast or a slow machine (the duration is
only a hang guard).
"""

from __future__ import annotations

import pytest

from test_cli_soak import _soak


@pytest.mark.integration
def test_switching_soak_loses_nothing_answers_every_switch_and_recovers_from_the_fault():
    # A 20 s run is all warm-up for the per-request memory fits (the daemon's RSS settles over minutes): leak
    # slopes are tested in test_soak_checks and measured by the long soak; this run checks what a switch and a
    # fault may break. A generous heartbeat: the killed worker, not a starved one, is the fault here.
    code, out, err = _soak("--backend", "ref", "--chips", "2", "--duration", "600", "--interval", "5s",
                           "--switch-every", "100req", "--fault-every", "250req", "--faults", "worker-kill",
                           "--switches", "4", "--leak-bytes-per-request", "1e9",
                           "--set", "recovery.heartbeat_timeout_ms=10000", timeout=600)
    verdict = out[-1]
    assert verdict["kind"] == "verdict", err[-3000:]
    assert verdict["violations"] == [] and verdict["violation_count"] == 0, verdict["violations"][:5]
    # nothing lost or duplicated, every token checked against its generation's package run alone
    assert verdict["lost"] == 0 and verdict["duplicated"] == 0
    assert verdict["requests"] > 0 and verdict["checked_against_oracle"] == verdict["requests"]
    assert verdict["verdict"] == "pass" and code == 0, err[-3000:]

    # every switch answered: replace to b, rollback to a, in turn, each a new generation
    sw = verdict["switches"]
    assert [s["op"] for s in sw] == ["replace", "rollback", "replace", "rollback"]
    assert [s["package"] for s in sw] == ["b", "a", "b", "a"] and all(s["error"] is None for s in sw)
    gens = [sw[0]["old_generation"], *(s["new_generation"] for s in sw)]
    assert gens == sorted(set(gens)) and all(s["old_generation"] == p for s, p in zip(sw, gens))
    assert [o for o in out if o["kind"] == "switch"] == [{"kind": "switch", **s} for s in sw]
    # requests finished on every generation, and some were in flight across a switch
    assert set(verdict["done_by_generation"]) == {str(g) for g in gens}
    assert verdict["across_switch"] > 0

    # the fault happened and was recovered: a worker killed, its chip back with another
    faults = verdict["faults"]
    assert len(faults) >= 1 and verdict["faults_recovered"] == len(faults), faults
    assert all(f["name"] == "worker-kill" and f["victim_pid"] and f["recovered"] for f in faults)
    assert set(verdict["errors_by_code"]) <= {"504", "500"}
    assert verdict["errors_by_code"].get("500", 0) == verdict["failed_by_fault"]

    # a round per switch plus the last, each on a settled board with the same workers and /dev/shm objects
    rounds = verdict["rounds"]
    assert len(rounds) == 5 and all(r["settled"] for r in rounds)
    assert {r["children"] for r in rounds} == {2}
    assert len({r["shm_objects"] for r in rounds}) == 1 and len({r["shm_mb"] for r in rounds}) == 1
    assert len({r["daemon_fds"] for r in rounds}) <= 2  # +-1: a client connection may be mid-close
