"""The suite fails a server that batches events for a client that did not ask (as a daemon with batching
forced on would), and passes the same scripted server when it sends one event per message.

The server is a ROUTER written here with plain pyzmq: it answers `health` with the documented minimum the
suite needs and a `generate` with one `tokens` event and its `done`, either as two messages or as the two
frames of one.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import orjson
import pytest
import zmq

from conftest import ROOT


class ScriptedRouter:
    def __init__(self, batch: bool) -> None:
        self.batch = batch
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, data = self.sock.recv_multipart()
            msg = orjson.loads(data)
            rid = msg.get("id")
            if msg.get("op") == "health":
                self.send(ident, [{"v": 1, "ev": "health", "id": rid, "ok": True,
                                   "model": {"alias": "fake", "vocab_size": 256, "max_seq": 2048, "text": False}}])
            elif msg.get("op") == "generate":
                toks = [(7 * i) % 250 + 1 for i in range(msg.get("max_tokens", 16))]
                self.send(ident, [{"v": 1, "ev": "tokens", "id": rid, "tokens": toks},
                                  {"v": 1, "ev": "done", "id": rid, "finish_reason": "length", "generation": 1,
                                   "usage": {"prompt_tokens": len(msg["prompt"]), "completion_tokens": len(toks),
                                             "cached_tokens": 0},
                                   "timing": {"ttft_ms": 1.0, "tpot_ms": 1.0, "e2e_ms": 2.0}}])

    def send(self, ident: bytes, events: list[dict]) -> None:
        frames = [orjson.dumps(e) for e in events]
        if self.batch:
            self.sock.send_multipart([ident, *frames])  # several events in one message, unasked
        else:
            for f in frames:
                self.sock.send_multipart([ident, f])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def scripted():
    made: list[ScriptedRouter] = []

    def make(batch: bool) -> ScriptedRouter:
        made.append(ScriptedRouter(batch))
        return made[-1]

    yield make
    for r in made:
        r.close()


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


def test_an_endpoint_that_does_not_answer_is_reported_with_what_to_do():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
