"""Loop-stall detection, on a fake clock."""

from __future__ import annotations

from engine.daemon.lifecycle.liveness import LoopLiveness


def test_sleeping_loop_is_not_stalled_however_long_it_sleeps():
    live = LoopLiveness(stall_threshold_s=2.0)
    live.woke(0.0)
    live.sleeping(0.001)
    assert not live.stalled(100.0)
    assert live.healthy(100.0)


def test_busy_turn_longer_than_threshold_is_a_stall():
    live = LoopLiveness(stall_threshold_s=2.0)
    live.woke(10.0)
    assert not live.stalled(11.9)
    assert live.stalled(12.1)
    assert not live.healthy(12.1)


def test_a_past_stall_stays_visible_for_the_window_then_clears():
    live = LoopLiveness(stall_threshold_s=1.0, window_s=5.0)
    live.woke(0.0)
    live.sleeping(3.0)  # a 3 s turn
    live.woke(3.5)
    assert live.lag_s(3.5) == 3.0
    assert not live.healthy(3.5)
    live.sleeping(3.6)
    live.woke(9.0)
    live.sleeping(9.001)
    assert live.healthy(9.001)
    assert live.lag_s(9.001) < 0.01
    assert live.max_turn_s == 3.0
    assert live.turns == 3
