"""The CLI: generate/health/stats against a real daemon, and `npuserve serve` with no args."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import orjson
import pytest

from daemon_procs import shm_objects_of
from repo_root import ROOT
from tools.stats_cmd import flatten, format_stats

NPUSERVE = [sys.executable, "-m", "tools.cli"]


def npuserve(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*NPUSERVE, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_stats_table_flattens_nested_sections():
    rows = flatten({"a": {"b": 1, "c": [1, 2]}, "d": [{"e": 2.5}]})
    assert rows == [("a.b", 1), ("a.c", [1, 2]), ("d[0].e", 2.5)]
    table = format_stats({"a": {"b": 1}, "z": {"y": 0.25}})
    assert "a.b  1" in table and "z.y  0.25" in table


@pytest.mark.integration
def test_generate_health_stats_commands(daemon):
    d = daemon(backend="stub", chips=1)
    r = npuserve("generate", "--endpoint", d.endpoint, "--prompt-tokens", "1,2,3", "--max-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    out = orjson.loads(r.stdout)
    assert len(out["tokens"]) == 6 and out["finish_reason"] == "length" and out["usage"]["prompt_tokens"] == 3

    r = npuserve("generate", "--endpoint", d.endpoint, "--prompt-tokens", "1,2,3", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert [int(x) for x in r.stdout.strip().split(",")] == out["tokens"]  # stub: same prompt, same seed

    r = npuserve("generate", "--endpoint", d.endpoint, "--text", "hello", "--max-tokens", "4", "--json")
    assert orjson.loads(r.stdout)["usage"]["prompt_tokens"] == 5

    r = npuserve("generate", "--endpoint", d.endpoint, "--prompt-tokens", "1", "--model", "nope")
    assert r.returncode == 1 and "404" in r.stderr

    r = npuserve("health", "--endpoint", d.endpoint)
    assert r.returncode == 0 and "ok:" in r.stdout and "up" in r.stdout
    h = orjson.loads(npuserve("health", "--endpoint", d.endpoint, "--json").stdout)
    assert h["ok"] is True and h["chips"][0]["state"] == "up"

    r = npuserve("stats", "--endpoint", d.endpoint)
    assert r.returncode == 0 and "frontend.requests" in r.stdout
    s = orjson.loads(npuserve("stats", "--endpoint", d.endpoint, "--json").stdout)
    assert s["frontend"]["requests"] >= 3


def test_health_of_nothing_fails_fast(short_dir):
    r = npuserve("health", "--endpoint", f"ipc://{short_dir}/none.sock", "--timeout", "0.3")
    assert r.returncode == 2 and "timeout" in r.stderr


@pytest.mark.integration
def test_serve_without_arguments_is_make_run(short_dir):
    """Default everything: ref tiny model, 2 chips, endpoint under the runtime dir, printed with an example."""
    env = dict(os.environ, XDG_RUNTIME_DIR=short_dir)
    env.pop("NPUSERVE_ENDPOINT", None)
    proc = subprocess.Popen([*NPUSERVE, "serve"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if line.startswith("stop with"):
                break
        expected = f"ipc://{short_dir}/npuserve/board-0.sock"
        assert expected in lines, lines  # the endpoint URL on a line of its own
        assert any("npuserve generate --endpoint" in ln and "--text" in ln for ln in lines)
        assert "2 chips" in lines[0] and "ref" in lines[0]
        r = npuserve("generate", "--text", "hello", "--max-tokens", "5", "--json", env=env)
        assert r.returncode == 0, r.stderr
        assert orjson.loads(r.stdout)["usage"]["prompt_tokens"] == 5
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert rc == 0, err[-2000:]
    assert shm_objects_of(proc.pid) == []
    assert not os.path.exists(f"{short_dir}/npuserve/board-0.sock")
