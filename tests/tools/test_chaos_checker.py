"""The chaos checker (`tools.chaos.harness.check_traces`) fails a run that lost or duplicated a terminal event.

Pure and fast: the traces are recorded by `WireLoad`'s own event handler from hand-made events, with no
daemon; the invariants are the ones every chaos scenario and the soak rely on.
"""

from __future__ import annotations

import asyncio

from tools.chaos.harness import ScenarioResult, check_traces, terminal_codes
from tools.load.wire_load import Trace, WireLoad


def recorded(events_by_request: dict[str, list[dict]]) -> list[Trace]:
    """What WireLoad records for these events, each request a stream of max_tokens=3."""
    load = WireLoad("ipc:///nonexistent/chaos-checker.sock")  # never connected: events are fed by hand
    try:
        for rid in events_by_request:
            load.traces[rid] = Trace(rid, "normal", {"prompt": [1], "max_tokens": 3})
            load._waiters[rid] = asyncio.Event()
        for rid, events in events_by_request.items():
            for i, ev in enumerate(events):
                load._on_event({"id": rid, **ev}, float(i))
        return list(load.traces.values())
    finally:
        load._sock.close(0)
        load._ctx.term()


TOKENS = {"ev": "tokens", "tokens": [7, 8, 9]}
DONE = {"ev": "done", "finish_reason": "length", "usage": {"completion_tokens": 3}}
ERR = {"ev": "error", "code": 500, "reason": "chip_failed", "retryable": False}


def run(events_by_request) -> ScenarioResult:
    res = ScenarioResult("checker")
    check_traces(res, recorded(events_by_request), allowed_errors={500})
    return res


def test_a_clean_run_passes():
    res = run({"a": [TOKENS, DONE], "b": [ERR]})
    assert res.passed, res.problems
    assert res.details["terminal"] == {"done:length": 1, "error:500": 1}


def test_a_lost_terminal_event_fails_the_run():
    res = run({"a": [TOKENS, DONE], "b": [TOKENS]})  # b streamed, then nothing
    assert not res.passed
    assert res.problems == ["request b: no terminal event"]
    assert res.details["terminal"] == {"done:length": 1, "none": 1}


def test_a_duplicated_terminal_event_fails_the_run():
    res = run({"a": [TOKENS, DONE, DONE]})
    assert not res.passed
    assert "request a: 2 terminal events" in res.problems
    assert "request a: 1 event(s) after the terminal event" in res.problems


def test_a_done_then_an_error_and_tokens_after_the_end_fail_the_run():
    res = run({"a": [TOKENS, DONE, ERR], "b": [DONE | {"usage": {"completion_tokens": 0}}, TOKENS]})
    assert not res.passed
    assert "request a: 2 terminal events" in res.problems
    assert "request b: 1 event(s) after the terminal event" in res.problems
    assert "request b: finished 'length' with 0 of 3 tokens" in res.problems


def test_an_error_the_fault_does_not_allow_fails_the_run():
    res = run({"a": [{"ev": "error", "code": 503, "reason": "shutdown", "retryable": True}]})
    assert res.problems == ["request a: error 503 shutdown not expected here"]


def test_terminal_codes_counts_missing_ones_as_none():
    assert terminal_codes(recorded({"a": [], "b": [ERR], "c": [TOKENS, DONE]})) == \
        {"none": 1, "error:500": 1, "done:length": 1}
