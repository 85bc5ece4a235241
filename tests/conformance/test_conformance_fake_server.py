"""The suite fails a server that batches events for a client that did not ask (as a daemon with batching
forced on would), passes the same scripted server when it sends one event per message, and fails it for each
other scripted breach of the document, in the check named for that promise.

The server is the scripted ROUTER of tests/fake_server.py (plain pyzmq) with the answers written here: it
answers `health` with the documented minimum the suite needs, a `generate` with one `tokens` event and its
`done` (or, with `stream: false`, the `done` alone) and a malformed message with its 400; each `fault` breaks
one promise.
"""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT
from tools.load.ports import free_port


class Script:
    """The scripted server's answers (`FakeServer` carries them), with one promise broken by `fault`."""

    def __init__(self, fault: str | None = None) -> None:
        self.fault = fault

    def handle(self, msg) -> list[dict]:
        if not isinstance(msg, dict) or msg.get("op") not in ("health", "generate", "cancel"):
            rid = msg.get("id") if isinstance(msg, dict) else None
            err = {"v": 1, "ev": "error", "id": rid, "code": 400, "reason": "unknown_op", "message": "op: unknown",
                   "retryable": False}
            if self.fault == "error_without_retryable":
                del err["retryable"]
            return [err]
        rid = msg.get("id")
        if msg["op"] == "health":
            return [{"v": 1, "ev": "health", "id": rid, "ok": True,
                     "model": {"alias": "fake", "vocab_size": 256, "max_seq": 2048, "text": False}}]
        if msg["op"] == "cancel":
            return [{"v": 1, "ev": "cancel", "id": rid}] if self.fault == "cancel_replied" else []
        return self.generate(msg)

    def generate(self, msg: dict) -> list[dict]:
        rid = msg["id"]
        toks = [(7 * i) % 250 + 1 for i in range(msg.get("max_tokens", 16))]
        done = {"v": 1, "ev": "done", "id": rid, "finish_reason": "length", "generation": 1,
                "usage": {"prompt_tokens": len(msg["prompt"]), "completion_tokens": len(toks), "cached_tokens": 0},
                "timing": {"ttft_ms": 1.0, "tpot_ms": 1.0, "e2e_ms": 2.0}}
        if self.fault == "usage_miscounted":
            done["usage"]["completion_tokens"] += 1
        events = [{"v": 1, "ev": "tokens", "id": rid, "tokens": toks}, done]
        if msg.get("stream") is False:
            events = [{**done, "tokens": toks}] if self.fault != "tokens_events_without_stream" else \
                [events[0], {**done, "tokens": toks}]
        if self.fault == "two_terminal_events":
            events.append(done)
        return events


@pytest.fixture
def scripted(fake_server):
    """`scripted(batch, fault)`: the scripted server; `batch`: several events in one message, unasked."""

    def make(batch: bool, fault: str | None = None):
        return fake_server(Script(fault).handle, batch=batch)

    return make


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", "conformance", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


CHECKS = "one_event_per_message,generate_stream"


def test_the_suite_fails_a_server_that_batches_events_unasked(scripted):
    server = scripted(batch=True)
    res = run_cli(server.endpoint, "--json", "--kind", "daemon", "--only", CHECKS)
    assert res.returncode == 1, res.stderr
    rows = {r["check"]: r for r in map(orjson.loads, res.stdout.splitlines()) if r["kind"] == "row"}
    for name in CHECKS.split(","):
        assert rows[name]["status"] == "fail", rows[name]
        assert "a message of 2 frames on a connection that did not opt in" in rows[name]["detail"], rows[name]
    (summary,) = [r for r in map(orjson.loads, res.stdout.splitlines()) if r["kind"] == "summary"]
    assert summary["ok"] is False and set(summary["failures"]) == set(CHECKS.split(","))


def test_the_same_server_passes_when_it_sends_one_event_per_message(scripted):
    server = scripted(batch=False)
    res = run_cli(server.endpoint, "--kind", "daemon", "--only", CHECKS)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "one_event_per_message" in res.stdout and "conforms" in res.stdout


FAULTS = [  # (the server's breach, the check that must fail for it, words of its failure)
    ("usage_miscounted", "generate_stream", "usage.completion_tokens is 9 but 8 token(s) were received"),
    ("two_terminal_events", "generate_stream", "1 event(s) after every request of the check had ended"),
    ("tokens_events_without_stream", "generate_no_stream", "stream: false got 1 tokens event(s)"),
    ("cancel_replied", "cancel_finished", "a cancel of a finished id was answered"),
    ("error_without_retryable", "error_400_unknown_op", "error.retryable is not a bool"),
]


@pytest.mark.parametrize("fault,check,words", FAULTS, ids=[f[0] for f in FAULTS])
def test_each_breach_fails_the_check_named_for_it(scripted, fault, check, words):
    server = scripted(batch=False, fault=fault)
    res = run_cli(server.endpoint, "--json", "--kind", "daemon", "--only", check)
    (row,) = [r for r in map(orjson.loads, res.stdout.splitlines()) if r["kind"] == "row"]
    assert res.returncode == 1 and row["status"] == "fail" and words in row["detail"], (res.stderr, row)
    clean = run_cli(scripted(batch=False).endpoint, "--kind", "daemon", "--only", check)
    assert clean.returncode == 0, clean.stdout  # the same check passes the faithful server


def test_an_endpoint_that_does_not_answer_is_reported_with_what_to_do():
    port = free_port()  # a port nobody listens on
    res = run_cli(f"tcp://127.0.0.1:{port}", "--timeout", "1")
    assert res.returncode == 2
    assert "no health reply" in res.stderr and "npuserve health" in res.stderr, res.stderr


def test_bad_invocations_say_what_to_give():
    res = run_cli()
    assert res.returncode == 2 and "give the ENDPOINT" in res.stderr
    res = run_cli("tcp://127.0.0.1:1", "--only", "no_such_check")
    assert res.returncode == 2 and "unknown check(s) ['no_such_check']" in res.stderr
    listed = run_cli("--list")
    assert listed.returncode == 0 and "error_400_duplicate_id" in listed.stdout and "needs --admin" in listed.stdout
