"""Prefill/decode disaggregation in the balancer core, on a fake clock: two legs, one client stream."""

from __future__ import annotations

import random

import pytest

from engine.balancer.actions import EmitTokens, FailRequest, FinishRequest, OpenBackend, SendUpstream
from engine.balancer.backend_state import BackendSpec
from engine.balancer.core import BalancerCore, CoreConfig
from engine.balancer.pd_routing import Stage
from engine.balancer.routing import Policy, RoutingPolicy

from test_balancer_core import beat, done, error, gen, sends, tokens, validate_request

P1, P2, D1, D2 = "tcp://p1:1", "tcp://p2:1", "tcp://d1:1", "tcp://d2:1"


def make(prefill=(P1,), decode=(D1,), mixed=(), now=0.0) -> BalancerCore:
    specs = ([BackendSpec(n, role="prefill") for n in prefill] + [BackendSpec(n, role="decode") for n in decode]
             + [BackendSpec(n) for n in mixed])
    core = BalancerCore(CoreConfig(routing=RoutingPolicy(policy=Policy.PREFIX, block_size=4)), specs, now,
                        random.Random(3))
    assert all(isinstance(a, OpenBackend) for a in core.take_setup_actions())
    beat(core, now)
    return core


def terminal(actions):
    return [a for a in actions if isinstance(a, (FinishRequest, FailRequest))]


def emitted(actions):
    return [t for a in actions if isinstance(a, EmitTokens) for t in a.tokens]


def run_prefill(core, rid=1, **kw):
    (s,) = sends(core.submit(rid, gen(max_tokens=5, **kw), 0.1))
    assert s.backend in (P1, P2) and s.msg["max_tokens"] == 1 and s.msg["handoff"] == {"export": True}
    return s


def test_two_legs_make_one_stream_with_the_prompt_counted_once():
    core = make()
    s = run_prefill(core)
    out = core.on_event(P1, tokens(s.msg["id"], [7]), 0.2)
    assert emitted(out) == [7]  # the first token reaches the client from the prefill board
    out = core.on_event(P1, done(s.msg["id"]), 0.21)
    (d,) = sends(out)
    assert d.backend == D1 and d.msg["continuation"] == [7] and d.msg["max_tokens"] == 5
    assert d.msg["handoff"]["board"] == P1 and d.msg["handoff"]["blocks"] == [] and "handoff" in d.msg
    assert not terminal(out)
    core.on_event(D1, tokens(d.msg["id"], [8, 9, 10, 11]), 0.3)
    (fin,) = terminal(core.on_event(D1, done(d.msg["id"]), 0.31))
    assert fin.usage == {"prompt_tokens": 3, "completion_tokens": 5, "cached_tokens": 0}
    assert core.active() == 0 and core.counters["pd_handoffs"] == 1
    assert not core.backends[P1].inflight and not core.backends[D1].inflight


def test_the_prefill_descriptor_is_passed_on_when_the_prefill_board_sends_one():
    core = make()
    s = run_prefill(core)
    core.on_event(P1, tokens(s.msg["id"], [7]), 0.2)
    desc = {"board": "p1", "request": "h9", "prompt_len": 3, "blocks": [4], "layout": {"block_size": 4}}
    (d,) = sends(core.on_event(P1, {**done(s.msg["id"]), "handoff": desc}, 0.21))
    assert d.msg["handoff"] == desc


@pytest.mark.parametrize("reason", ["eos", "stop"])
def test_a_prefill_leg_that_ends_the_request_ends_it(reason):
    core = make()
    s = run_prefill(core)
    out = core.on_event(P1, done(s.msg["id"], reason), 0.2)
    assert not sends(out) and [a.finish_reason for a in terminal(out)] == [reason]


def test_short_requests_and_a_missing_prefill_board_go_whole_to_a_decode_board():
    core = make()
    (s,) = sends(core.submit(1, gen(max_tokens=1), 0.1))
    assert s.backend == D1 and "handoff" not in s.msg
    core = make()
    beat(core, 5.0, only={D1})  # the prefill board misses its heartbeats
    beat(core, 6.0, only={D1})
    beat(core, 8.5, only={D1})
    (s,) = sends(core.submit(2, gen(max_tokens=5), 8.6))
    assert s.backend == D1 and "handoff" not in s.msg and core.counters["pd_whole_fallbacks"] == 1


def test_stop_sequences_hide_the_prefill_token_and_the_decode_leg_resamples_it():
    core = make()
    s = run_prefill(core, stop=[[7, 8]])
    assert emitted(core.on_event(P1, tokens(s.msg["id"], [7]), 0.2)) == []
    (d,) = sends(core.on_event(P1, done(s.msg["id"]), 0.21))
    assert d.msg["continuation"] == []  # the decode board samples the first token itself
    out = core.on_event(D1, tokens(d.msg["id"], [7, 9]), 0.3)
    assert emitted(out) == [7, 9]


def test_hidden_output_is_shown_when_the_prefill_leg_ends_the_request():
    core = make()
    s = run_prefill(core, stop=[[7, 8]])
    core.on_event(P1, tokens(s.msg["id"], [5]), 0.2)
    out = core.on_event(P1, done(s.msg["id"], "eos"), 0.21)
    assert emitted(out) == [5] and terminal(out)[0].usage["completion_tokens"] == 1


def test_decode_board_lost_mid_stream_migrates_to_another_decode_board():
    core = make(decode=(D1, D2))
    s = run_prefill(core)
    core.on_event(P1, tokens(s.msg["id"], [7]), 0.2)
    (d,) = sends(core.on_event(P1, done(s.msg["id"]), 0.21))
    core.on_event(d.backend, tokens(d.msg["id"], [8]), 0.3)
    out = core.on_disconnect(d.backend, 0.4)
    (d2,) = sends(out)
    assert d2.backend in (D1, D2) and d2.backend != d.backend and d2.msg["continuation"] == [7, 8]
    assert not terminal(out)
    (fin,) = terminal(core.on_event(d2.backend, done(d2.msg["id"]), 0.5))
    assert fin.usage["completion_tokens"] == 2 and core.active() == 0


def test_prefill_board_lost_before_it_answered_retries_on_another_prefill_board():
    core = make(prefill=(P1, P2))
    s = run_prefill(core)
    (s2,) = sends(core.on_disconnect(s.backend, 0.2))
    assert s2.backend != s.backend and s2.msg["max_tokens"] == 1


def test_prefill_board_lost_after_its_token_continues_on_a_decode_board():
    core = make()
    s = run_prefill(core)
    core.on_event(P1, tokens(s.msg["id"], [7]), 0.2)
    (d,) = sends(core.on_disconnect(P1, 0.3))
    assert d.backend == D1 and d.msg["continuation"] == [7] and d.msg["max_tokens"] == 5


def test_cancel_during_either_leg_gives_one_terminal_event():
    core = make()
    s = run_prefill(core)
    (c,) = sends(core.cancel(1, 0.15), "cancel")
    assert c.backend == P1
    out = core.on_event(P1, done(s.msg["id"]), 0.2)  # the prefill board raced to a length finish
    assert not sends(out) and [a.finish_reason for a in terminal(out)] == ["cancelled"]
    s = run_prefill(core, rid=2)
    core.on_event(P1, tokens(s.msg["id"], [7]), 0.2)
    (d,) = sends(core.on_event(P1, done(s.msg["id"]), 0.21))
    (c,) = sends(core.cancel(2, 0.25), "cancel")
    assert c.backend == D1
    out = core.on_event(D1, done(d.msg["id"], "cancelled"), 0.3)
    assert len(terminal(out)) == 1 and core.active() == 0


def test_a_full_decode_board_is_retried_after_a_backoff_and_kv_headroom_breaks_ties():
    core = make(decode=(D1, D2))
    beat(core, 0.05)
    core.backends[D1].reported["load"] = {"kv_used": 0.97}
    s = run_prefill(core)
    core.on_event(P1, tokens(s.msg["id"], [7]), 0.2)
    (d,) = sends(core.on_event(P1, done(s.msg["id"]), 0.21))
    assert d.backend == D2  # D1 is nearly full
    assert sends(core.on_event(D2, error(d.msg["id"], 429), 0.22)) == []
    (d2,) = sends(core.tick(2.0))
    assert d2.msg["continuation"] == [7] and core.backends[P1].inflight == set()


def test_without_both_roles_nothing_changes():
    core = make(prefill=(), decode=(D1,), mixed=(P1,))
    assert not core.pd
    (s,) = sends(core.submit(1, gen(max_tokens=5), 0.1))
    assert "handoff" not in s.msg and s.msg["max_tokens"] == 5
    assert core._reqs[1].stage is Stage.WHOLE


def test_both_legs_carry_the_requests_lora_adapter():
    """The adapter is part of the KV's key on both boards (its sha256 salts the prefix hashes): the prefill
    leg computes the prompt under it and the decode leg imports it under it."""
    core = make()
    s = run_prefill(core, adapter="sql")
    assert s.msg["adapter"] == "sql"
    core.on_event(P1, tokens(s.msg["id"], [7]), 0.2)
    (d,) = sends(core.on_event(P1, done(s.msg["id"]), 0.21))
    assert d.backend == D1 and d.msg["adapter"] == "sql"


def make_min(min_prompt: int) -> BalancerCore:
    specs = [BackendSpec(P1, role="prefill"), BackendSpec(D1, role="decode")]
    core = BalancerCore(CoreConfig(routing=RoutingPolicy(policy=Policy.PREFIX, block_size=4,
                                                         pd_min_prompt_tokens=min_prompt)), specs, 0.0,
                        random.Random(3))
    core.take_setup_actions()
    beat(core, 0.0)
    return core


def test_prompts_shorter_than_pd_min_prompt_tokens_go_whole_to_a_decode_board():
    core = make_min(8)
    (short,) = sends(core.submit(1, gen(prompt=range(1, 8), max_tokens=5), 0.1))  # 7 tokens < 8: co-located
    assert short.backend == D1 and short.msg["max_tokens"] == 5 and "handoff" not in short.msg
    (long,) = sends(core.submit(2, gen(prompt=range(1, 9), max_tokens=5), 0.1))  # 8 tokens: handed off
    assert long.backend == P1 and long.msg["max_tokens"] == 1 and long.msg["handoff"] == {"export": True}
    # the continuation counts with the prompt: 6 + 2 tokens are worth a hand-off
    (cont,) = sends(core.submit(3, gen(prompt=range(1, 7), max_tokens=5, continuation=[9, 9]), 0.1))
    assert cont.backend == P1 and cont.msg["handoff"] == {"export": True}
    # a text prompt's length is not known to the balancer: it is handed off as before
    (txt,) = sends(core.submit(4, validate_request({"v": 1, "op": "generate", "id": "t", "text": "hi",
                                                    "max_tokens": 5}), 0.1))
    assert txt.backend == P1


def test_pd_min_prompt_tokens_zero_hands_off_every_prompt():
    core = make_min(0)
    (s,) = sends(core.submit(1, gen(prompt=(1,), max_tokens=5), 0.1))
    assert s.backend == P1 and s.msg["handoff"] == {"export": True}
