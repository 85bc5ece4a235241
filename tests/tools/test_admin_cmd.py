"""`npuserve admin`: argument parsing, the wire fields of each op, output, and exit codes with hints.

`models` runs against a real daemon. The lifecycle ops' replies and refusals
come from a scripted server (fake_server.FakeServer, a real ZeroMQ ROUTER) that
answers with the documented contract (docs/protocol.md), so every exit path
of the CLI is pinned whatever daemon it is merged with.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import time

import orjson
import pytest

from repo_root import ROOT
from test_cli_commands import NPUSERVE, npuserve
from tools import admin_cmd

ENTRY = {"alias": "chat", "generation": 3, "state": "ready", "package": "chat-v2", "sha256": "ab" * 32,
         "default": False, "active_requests": 0, "counters": {"requests": 0}, "error": None}
PREVIOUS = dict(ENTRY, generation=2, state="unloaded", package="chat-v1", sha256="cd" * 32)


def reply(msg: dict, body: dict) -> list[dict]:
    return [{"v": 1, "ev": msg["op"], "id": msg["id"], **body}]


def error(msg: dict, code: int, reason: str, message: str, **extra) -> list[dict]:
    return [{"v": 1, "ev": "error", "id": msg["id"], "code": code, "reason": reason, "message": message,
             "retryable": False, **extra}]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = admin_cmd.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_each_op_sends_exactly_the_contract_fields(fake_server, capsys):
    def handler(msg):
        if msg["op"] == "replace":
            return reply(msg, {"model": ENTRY, "previous": PREVIOUS})
        if msg["op"] == "models":
            return reply(msg, {"models": [ENTRY, PREVIOUS]})
        return reply(msg, {"model": ENTRY})

    s = fake_server(handler)
    e = s.endpoint
    assert run(capsys, "--endpoint", e, "load", "chat", "chat-v2")[0] == 0
    assert run(capsys, "unload", "chat", "--endpoint", e, "--deadline", "2.5")[0] == 0
    assert run(capsys, "--endpoint", e, "replace", "chat", "chat-v2", "--deadline", "0")[0] == 0
    assert run(capsys, "--endpoint", e, "rollback", "chat")[0] == 0
    assert run(capsys, "--endpoint", e, "models")[0] == 0
    sent = [{k: v for k, v in m.items() if k not in ("v", "id")} for m in s.received]
    assert sent == [
        {"op": "load", "alias": "chat", "package": "chat-v2"},
        {"op": "unload", "alias": "chat", "deadline_s": 2.5},
        {"op": "replace", "alias": "chat", "package": "chat-v2", "deadline_s": 0.0},
        {"op": "rollback", "alias": "chat"},
        {"op": "models"},
    ]


def test_replies_print_as_a_table_or_json_lines(fake_server, capsys):
    s = fake_server(lambda msg: reply(msg, {"model": ENTRY, "previous": PREVIOUS}) if msg["op"] == "replace"
                    else reply(msg, {"models": [ENTRY, PREVIOUS]}))
    rc, out, _ = run(capsys, "--endpoint", s.endpoint, "replace", "chat", "chat-v2")
    lines = out.splitlines()
    assert rc == 0 and lines[0] == "replaced chat: generation 3 is ready (previous: generation 2, unloaded)"
    assert lines[2].split() == ["alias", "gen", "state", "default", "active", "sha256", "package", "error"]
    assert lines[3].split() == ["chat", "3", "ready", "no", "0", "ab" * 6, "chat-v2", "-"]
    assert lines[4].split() == ["chat", "2", "unloaded", "no", "0", "cd" * 6, "chat-v1", "-"]
    rc, out, _ = run(capsys, "--endpoint", s.endpoint, "replace", "chat", "chat-v2", "--json")
    assert rc == 0 and orjson.loads(out) == {"op": "replace", "model": ENTRY, "previous": PREVIOUS}
    rc, out, _ = run(capsys, "models", "--json", "--endpoint", s.endpoint)
    assert rc == 0 and [orjson.loads(ln) for ln in out.splitlines()] == [ENTRY, PREVIOUS]


def test_a_refused_load_exits_1_naming_the_step_and_cause(fake_server, capsys):
    s = fake_server(lambda msg: error(msg, 400, "package_refused", "/m/chat/model.gguf: sha256 does not match "
                                      "the manifest", step="verify"))
    rc, out, err = run(capsys, "--endpoint", s.endpoint, "load", "chat", "chat")
    assert (rc, out) == (1, "")
    assert err == "npuserve admin: load refused at step verify: /m/chat/model.gguf: sha256 does not match " \
                  "the manifest\n"
    named = fake_server(lambda msg: error(msg, 429, "insufficient_capacity", "load 'chat': capacity: needs 2.0 GB, "
                                          "the board has 1.0 GB free", step="capacity"))
    rc, _, err = run(capsys, "--endpoint", named.endpoint, "load", "chat", "chat")
    assert rc == 1 and err == "npuserve admin: refused: load 'chat': capacity: needs 2.0 GB, the board has 1.0 GB free\n"
    s404 = fake_server(lambda msg: error(msg, 404, "model_not_found", "no model 'x' on this board"))
    rc, _, err = run(capsys, "--endpoint", s404.endpoint, "unload", "x")
    assert rc == 1 and "unload failed: 404 model_not_found: no model 'x' on this board" in err


@pytest.mark.parametrize("code,reason,hint", [
    (501, "not_implemented", "serves the model it was started with"),
    (403, "forbidden", "admin ops need the board's ipc:// socket"),
    (400, "unknown_field", "the daemon rejected the request"),
])
def test_errors_the_operator_must_fix_exit_2_with_a_hint(fake_server, capsys, code, reason, hint):
    s = fake_server(lambda msg: error(msg, code, reason, "nope"))
    rc, _, err = run(capsys, "--endpoint", s.endpoint, "rollback", "chat")
    assert rc == 2 and hint in err and "nope" in err


def test_no_daemon_exits_2_and_says_where_to_look(short_dir, capsys):
    ep = f"ipc://{short_dir}/none.sock"
    rc, _, err = run(capsys, "--endpoint", ep, "--timeout", "0.3", "load", "a", "p")
    assert rc == 2 and f"no reply from {ep} within 0.3 s" in err and "may still be carrying it out" in err
    assert f"npuserve health --endpoint {ep}" in err


def test_usage_errors_exit_2(capsys):
    for argv in (["load", "chat"], ["frobnicate"], ["unload", "chat", "--deadline", "-1"], []):
        with pytest.raises(SystemExit) as info:
            admin_cmd.main(argv)
        assert info.value.code == 2, argv
    capsys.readouterr()


def test_a_long_op_shows_elapsed_time_on_a_terminal(fake_server):
    def slow(msg):
        time.sleep(1.0)
        return reply(msg, {"model": ENTRY})

    s = fake_server(slow)
    master, slave = pty.openpty()
    proc = subprocess.Popen([*NPUSERVE, "admin", "--endpoint", s.endpoint, "load", "chat", "chat-v2"], cwd=ROOT,
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(30) == 0
    finally:
        os.close(master)
    text = seen.decode(errors="replace")
    assert re.search(r"load chat chat-v2 \.\.\. \d+\.\d s", text), text  # the spinner with the elapsed time
    assert "loaded chat: generation 3 is ready" in text


@pytest.mark.integration
def test_models_against_a_real_daemon(daemon):
    d = daemon(backend="ref", chips=1)
    r = npuserve("admin", "--endpoint", d.endpoint, "models")
    assert r.returncode == 0, r.stderr
    header, row = r.stdout.splitlines()[:2]
    assert header.split()[:3] == ["alias", "gen", "state"]
    with d.client(timeout=10) as c:
        info = c.call("models")["models"][0]
    assert row.split()[:2] == ["tiny", str(info["generation"])] and info["sha256"][:12] in row
    r = npuserve("admin", "models", "--endpoint", d.endpoint, "--json")
    assert r.returncode == 0 and [orjson.loads(ln) for ln in r.stdout.splitlines()] == [info]


def test_drain_and_resume_send_timeout_ms_and_backend_and_say_what_happened(fake_server, capsys):
    def handler(msg):
        if msg.get("backend"):
            return reply(msg, {"backend": msg["backend"], "drained": msg["op"] == "drain"})
        body = {"accepting": msg["op"] == "resume"}
        if msg.get("timeout_ms") is not None:
            body["timeout_ms"] = msg["timeout_ms"]
        return reply(msg, body)

    s = fake_server(handler)
    e = s.endpoint
    rc, out, _ = run(capsys, "--endpoint", e, "drain", "--timeout", "2.5")
    assert rc == 0 and "in-flight ones finish within 2.5 s, then are ended" in out
    rc, out, _ = run(capsys, "drain", "--endpoint", e)
    assert rc == 0 and "draining" in out and "within" not in out
    rc, out, _ = run(capsys, "--endpoint", e, "drain", "--backend", "tcp://10.0.0.12:7070", "--json")
    assert rc == 0 and orjson.loads(out) == {"op": "drain", "backend": "tcp://10.0.0.12:7070", "drained": True}
    rc, out, _ = run(capsys, "--endpoint", e, "resume")
    assert rc == 0 and out.strip() == "accepting new requests"
    sent = [{k: v for k, v in m.items() if k not in ("v", "id")} for m in s.received]
    assert sent == [{"op": "drain", "timeout_ms": 2500}, {"op": "drain"},
                    {"op": "drain", "backend": "tcp://10.0.0.12:7070"}, {"op": "resume"}]
    with pytest.raises(SystemExit):
        admin_cmd.parse_args(["drain", "--timeout", "-1"])


def test_drain_with_a_timeout_at_a_real_balancer_ends_what_is_left_then_resume_admits(daemon, short_dir):
    import subprocess as sp
    import sys

    from engine.client import Client
    from engine.errors import ClientError

    d = daemon(backend="sim", backend_options={"decode_base_ms": 5.0})
    ep = f"ipc://{short_dir}/bal.sock"
    with open(os.path.join(short_dir, "bal.log"), "wb") as log:
        bal = sp.Popen([sys.executable, "-m", "engine.balancer.main", "--endpoint", ep, "--backends", d.endpoint],
                       cwd=ROOT, stdout=log, stderr=sp.STDOUT)
    try:
        with Client(ep, timeout=30) as c:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if c.health().get("backends_up") == 1:
                        break
                except ClientError:
                    pass
                time.sleep(0.1)
            stream = c.stream([1, 2, 3], max_tokens=2000, ignore_eos=True)  # 10 s at 5 ms a step
            next(stream)  # streaming through the balancer
            assert admin_cmd.main(["--endpoint", ep, "drain", "--timeout", "0.3"]) == 0
            with pytest.raises(ClientError) as info:
                c.generate([4], max_tokens=1)
            assert info.value.reason == "draining"
            with pytest.raises(ClientError) as ended:
                for _ in stream:
                    pass
            assert ended.value.code == 503 and ended.value.reason == "shutdown" and ended.value.retryable
            assert admin_cmd.main(["--endpoint", ep, "resume"]) == 0
            assert len(c.generate([4], max_tokens=2).tokens) == 2
    finally:
        bal.terminate()
        assert bal.wait(30) == 0
