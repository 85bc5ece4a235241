"""`n` > 1 through the balancer core (fake clock): one board, each choice's events to its own stream."""

from __future__ import annotations

import pytest

from engine.balancer.actions import EmitTokens, FailRequest, FinishRequest

from test_balancer_core import A, B, gen, make, sends

RIDS = [11, 12, 13]  # the choices' client streams of core request 1


def _submit(core):
    core.choices.add(1, RIDS)
    (s,) = sends(core.submit(1, gen(n=3, max_tokens=4), 0.1))
    return s


def _ev(s, kind, index, **kw):
    return {"v": 1, "ev": kind, "id": s.msg["id"], "index": index, **kw}


def _done(s, index, reason="length"):
    return _ev(s, "done", index, finish_reason=reason, usage={"prompt_tokens": 3, "completion_tokens": 1,
                                                              "cached_tokens": 0}, timing={})


def test_choices_go_whole_to_one_board_and_each_choice_to_its_stream():
    core = make()
    s = _submit(core)
    assert s.msg["n"] == 3
    out = core.on_event(s.backend, _ev(s, "tokens", 2, tokens=[9]), 0.2)
    out += core.on_event(s.backend, _ev(s, "tokens", 0, tokens=[7]), 0.2)
    assert [(a.request_id, a.tokens) for a in out] == [(13, [9]), (11, [7])]
    ends = []
    for k in (1, 0, 2):
        ends += [a for a in core.choices.fan(core.on_event(s.backend, _done(s, k), 0.3))
                 if isinstance(a, FinishRequest)]
        assert core.active() == (0 if k == 2 else 1)
    assert [a.request_id for a in ends] == [12, 11, 13]


def test_a_refusal_before_any_choice_showed_anything_is_retried_whole_elsewhere():
    core = make(names=(A, B))
    s = _submit(core)
    err = _ev(s, "error", 0, code=429, reason="queue_full", message="full", retryable=True)
    assert core.on_event(s.backend, err, 0.2) == []  # waits for a backoff, then goes to the other board
    out = core.tick(0.25)
    (again,) = sends(out)
    assert again.backend != s.backend and again.msg["n"] == 3


def test_a_broken_stream_fails_every_choice_not_ended_and_is_not_migrated():
    core = make(names=(A, B))
    s = _submit(core)
    core.on_event(s.backend, _ev(s, "tokens", 1, tokens=[5]), 0.2)
    core.on_event(s.backend, _done(s, 1), 0.2)
    out = core.choices.fan(core.on_disconnect(s.backend, 0.3))
    assert not sends(out)
    fails = [a for a in out if isinstance(a, FailRequest)]
    assert [(a.request_id, a.reason) for a in fails] == [(11, "stream_broken"), (13, "stream_broken")]
    assert core.active() == 0 and not [a for a in out if isinstance(a, EmitTokens)]


def test_a_cancel_before_dispatch_ends_every_choice():
    core = make(names=())
    core.choices.add(1, RIDS)
    assert not sends(core.submit(1, gen(n=3), 0.1))  # no backend yet: waits
    out = core.choices.fan(core.cancel(1, 0.2))
    assert [(a.request_id, a.finish_reason) for a in out if isinstance(a, FinishRequest)] == \
        [(11, "cancelled"), (12, "cancelled"), (13, "cancelled")]


@pytest.mark.integration
def test_through_a_balancer_the_choices_are_the_boards(daemon, balancer):
    from balancer_procs import tcp_daemon

    d, e = tcp_daemon(daemon, backend="ref")
    b = balancer(backends=[e])
    prompt = list(range(40, 90))
    with d.client(timeout=120) as c:
        direct = c.generate_choices(prompt, 3, max_tokens=5, seed=3, temperature=0.9)
    with b.client(timeout=120) as c:
        via = c.generate_choices(prompt, 3, max_tokens=5, seed=3, temperature=0.9)
    assert [r.tokens for r in via] == [r.tokens for r in direct]
    assert len({tuple(r.tokens) for r in via}) == 3
