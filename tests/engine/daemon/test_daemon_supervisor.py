"""Worker supervision rules, on a fake clock (no processes)."""

from __future__ import annotations

import pytest

from engine.daemon.supervisor import RATE_WINDOW_S, ChipState, Decision, Supervisor


def make(chips=2, resets=2, hb=1.0, startup=30.0, now=0.0) -> Supervisor:
    s = Supervisor(chips, max_resets_per_10min=resets, heartbeat_timeout_s=hb, startup_timeout_s=startup, now=now)
    for c in range(chips):
        s.on_ready(c, now)
    return s


def test_healthy_chip_is_not_failed():
    s = make()
    assert s.check(0, alive=True, last_heartbeat=9.5, now=10.0) is None


def test_dead_process_is_a_failure():
    s = make()
    assert s.check(0, alive=False, last_heartbeat=10.0, now=10.0) == "worker process died"


def test_heartbeat_older_than_timeout_is_a_failure_and_not_before():
    s = make(hb=1.0)
    assert s.check(0, alive=True, last_heartbeat=10.0, now=10.99) is None
    reason = s.check(0, alive=True, last_heartbeat=10.0, now=11.01)
    assert reason is not None and "heartbeat" in reason


def test_restarting_chip_is_judged_by_startup_timeout_not_heartbeat():
    s = make(hb=1.0, startup=5.0)
    assert s.on_failure(0, "x", now=100.0) is Decision.RESTART
    assert s.state(0) is ChipState.RESTARTING
    assert s.check(0, alive=True, last_heartbeat=0.0, now=104.0) is None  # silent but still starting
    assert "not ready" in s.check(0, alive=True, last_heartbeat=0.0, now=105.5)
    s.on_ready(0, 104.0)
    assert s.state(0) is ChipState.UP


def test_restart_rate_limit_takes_chip_out_and_other_chip_stays():
    s = make(resets=2)
    assert s.on_failure(0, "a", now=0.0) is Decision.RESTART
    s.on_ready(0, 1.0)
    assert s.on_failure(0, "b", now=2.0) is Decision.RESTART
    s.on_ready(0, 3.0)
    assert s.on_failure(0, "c", now=4.0) is Decision.TAKE_OUT
    assert s.state(0) is ChipState.OUT
    assert s.check(0, alive=False, last_heartbeat=0.0, now=5.0) is None  # out chips are not judged again
    assert s.in_service() == [1]
    assert not s.all_out()
    snap = s.snapshot(5.0)
    assert snap[0]["state"] == "out" and snap[0]["last_failure"] == "c" and snap[0]["restarts_10min"] == 2


def test_rate_limit_window_slides():
    s = make(resets=1)
    assert s.on_failure(0, "a", now=0.0) is Decision.RESTART
    s.on_ready(0, 1.0)
    assert s.on_failure(0, "b", now=RATE_WINDOW_S + 0.5) is Decision.RESTART  # the first restart has aged out


def test_zero_resets_means_never_restart():
    s = make(chips=1, resets=0)
    assert s.on_failure(0, "a", now=0.0) is Decision.TAKE_OUT
    assert s.all_out()


@pytest.mark.parametrize("bad", [dict(chips=0), dict(resets=-1), dict(hb=0.0)])
def test_rejects_nonsense(bad):
    with pytest.raises(AssertionError):
        make(**bad)
