"""The switching soak's pure parts: which generation a request may run on, and its periods."""

from __future__ import annotations

import argparse

import pytest

from tools.soak.periods import Every, parse_every
from tools.soak.switches import Generations, Switch


def _gens() -> Generations:
    g = Generations(1, "a")
    g.switches = [Switch(1, "replace", asked=10.0, answered=12.0, old_generation=1, new_generation=2, package="b"),
                  Switch(2, "rollback", asked=20.0, answered=21.0, old_generation=2, new_generation=3, package="a")]
    return g


def test_a_request_may_run_only_on_the_generation_published_when_it_was_sent():
    g = _gens()
    assert g.allowed(5.0) == {1}
    assert g.allowed(15.0) == {2}
    assert g.allowed(30.0) == {3}


def test_a_request_sent_during_a_switch_may_run_on_the_old_or_the_new_generation():
    g = _gens()
    assert g.allowed(11.0) == {1, 2}
    assert g.allowed(20.5) == {2, 3}


def test_no_verdict_while_the_new_generation_is_unknown_or_after_a_failed_switch():
    g = _gens()
    g.switches.append(Switch(3, "replace", asked=40.0, old_generation=3))  # not answered yet
    assert g.allowed(41.0) is None
    assert g.allowed(39.0) == {3}
    g.switches[-1].answered, g.switches[-1].error = 42.0, "ClientTimeout: no reply"
    assert g.allowed(50.0) is None


def test_switches_alternate_replace_and_rollback():
    g = Generations(1, "a")
    ops = []
    for n in range(4):
        ops.append(g.next_op())
        g.switches.append(Switch(n + 1, ops[-1], asked=float(n)))
    assert ops == ["replace", "rollback", "replace", "rollback"]


def test_periods_are_durations_or_request_counts():
    assert parse_every("5m") == Every(seconds=300.0)
    assert parse_every("300") == Every(seconds=300.0)
    assert parse_every("400req") == Every(requests=400)
    assert Every(requests=400).due(0.0, 100, 1e9, 499) is False
    assert Every(requests=400).due(0.0, 100, 0.0, 500) is True
    assert Every(seconds=300.0).due(10.0, 0, 309.0, 10**6) is False
    assert Every(seconds=300.0).due(10.0, 0, 310.0, 0) is True
    for bad in ("0req", "0", "often"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_every(bad)
