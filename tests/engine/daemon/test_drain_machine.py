"""The SIGTERM drain as a pure state machine over a fake clock."""

from __future__ import annotations

import pytest

from engine.daemon.lifecycle.drain import Drain, DrainState, SignalOutcome, StopCause


def test_first_signal_drains_until_nothing_is_in_flight():
    d = Drain()
    assert d.check(0.0, 5) is None  # serving: nothing to decide
    assert d.on_stop_signal(10.0, 30.0) is SignalOutcome.BEGIN_DRAIN
    assert d.state is DrainState.DRAINING and d.deadline == 40.0
    assert d.check(11.0, 3) is None and d.remaining_s(11.0) == 29.0
    assert d.check(12.0, 0) is StopCause.DRAINED
    assert d.state is DrainState.STOPPING


def test_the_deadline_ends_the_drain_with_requests_left():
    d = Drain()
    d.on_stop_signal(0.0, 2.5)
    assert d.check(2.49, 4) is None
    assert d.check(2.5, 4) is StopCause.DEADLINE
    assert d.remaining_s(3.0) == 0.0


def test_a_second_signal_ends_it_at_once_and_a_third_is_ignored():
    d = Drain()
    d.on_stop_signal(0.0, 30.0)
    assert d.on_stop_signal(1.0, 30.0) is SignalOutcome.STOP_NOW
    assert d.cause is StopCause.SECOND_SIGNAL and d.state is DrainState.STOPPING
    assert d.on_stop_signal(1.5, 30.0) is SignalOutcome.IGNORED
    assert d.check(2.0, 7) is StopCause.SECOND_SIGNAL  # stays stopped whatever is in flight


def test_a_zero_budget_stops_at_the_first_check():
    d = Drain()
    d.on_stop_signal(5.0, 0.0)
    assert d.check(5.0, 1) is StopCause.DEADLINE


def test_negative_budget_is_a_bug():
    with pytest.raises(AssertionError):
        Drain().on_stop_signal(0.0, -1.0)
