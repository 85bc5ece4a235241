"""Penalised streams behind a real balancer: it forwards the penalty fields, refuses out-of-range ones naming
the field, and a stream it resumes on another board after a kill -9 continues exactly (the new board rebuilds
the counts from the prompt and the continuation)."""

from __future__ import annotations

import os
import signal

import pytest
from balancer_procs import tcp_daemon
from raw_streams import gen_msg, run_streams, streamed_tokens, terminal_events

from engine.errors import InvalidRequest

pytestmark = pytest.mark.integration

PENALTIES = [dict(frequency_penalty=1.0), dict(presence_penalty=1.5, repetition_penalty=1.2),
             dict(logit_bias={"65": 3.0, "66": -100.0}, min_p=0.05), dict(min_tokens=40, frequency_penalty=-0.3)]


def test_a_penalised_stream_resumed_by_the_balancer_continues_exactly(daemon, balancer):
    (d1, e1), (d2, e2) = tcp_daemon(daemon, backend="ref"), tcp_daemon(daemon, backend="ref")
    b = balancer(backends=[e1, e2], policy="least-load")
    msgs = [gen_msg(f"r{i}", [10 + i, 20, 30, 40], max_tokens=60, temperature=0.9, seed=100 + i, **PENALTIES[i % 4])
            for i in range(6)]
    expected = run_streams(d1.endpoint, msgs)  # the uninterrupted run
    d2.expect_exit = None
    killed: dict = {}

    def kill_when_streaming(events, sock):
        if killed or not all(len(streamed_tokens(events.get(m["id"], []))) >= 15 for m in msgs):
            return
        os.kill(d2.pid, signal.SIGKILL)
        killed["yes"] = True

    got = run_streams(b.endpoint, msgs, on_progress=kill_when_streaming)
    for m in msgs:
        rid = m["id"]
        terms = terminal_events(got[rid])
        assert len(terms) == 1 and terms[0]["ev"] == "done", (rid, terms)
        assert streamed_tokens(got[rid]) == streamed_tokens(expected[rid]), rid
    with b.client(timeout=10) as c:
        assert c.stats()["balancer"]["counters"].get("migrations", 0) >= 1
        with pytest.raises(InvalidRequest) as info:
            c.generate([1, 2, 3], max_tokens=4, min_p=2)
        assert info.value.args[0].startswith("min_p:")
        with pytest.raises(InvalidRequest) as info:  # the board's check, passed on
            c.generate([1, 2, 3], max_tokens=4, logit_bias={"100000": 1})
        assert info.value.reason == "token_out_of_range" and info.value.args[0].startswith("logit_bias:")
