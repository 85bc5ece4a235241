"""`npuserve stats` (the metrics dashboard) and `npuserve top` against a real daemon, and the quantile maths."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import time

import orjson
import pytest

from repo_root import ROOT
from test_cli_commands import NPUSERVE, npuserve
from tools.stats_cmd import format_report
from tools.stats_view import Figures, render


def _hist(buckets: dict[str, float]) -> list[dict]:
    return [{"name": "npuserve:x", "type": "histogram", "help": "",
             "samples": [["npuserve:x_bucket", {"le": le}, v] for le, v in buckets.items()]}]


def test_quantile_interpolates_within_a_bucket_like_prometheus():
    f = Figures(_hist({"0.1": 0, "0.5": 10, "1.0": 20, "+Inf": 20}))
    assert f.quantile("x", 0.5) == pytest.approx(0.5)  # rank 10 ends the (0.1, 0.5] bucket
    assert f.quantile("x", 0.75) == pytest.approx(0.75)  # halfway through (0.5, 1.0]
    assert f.quantile("x", 0.25) == pytest.approx(0.3)
    below = Figures(_hist({"0.01": 4, "0.1": 4, "+Inf": 4}))
    assert below.quantile("x", 0.5) == -0.01  # all in the first bucket: "below 10 ms", not a guess
    above = Figures(_hist({"0.01": 0, "0.1": 0, "+Inf": 3}))
    assert above.quantile("x", 0.5) == 0.1
    assert Figures([]).quantile("x", 0.5) is None


def test_render_shows_rates_against_a_previous_reply():
    def reply(tokens: float) -> dict:
        return {"uptime_s": 1.0, "metrics": [{"name": "npuserve:generation_tokens", "type": "counter", "help": "",
                                              "samples": [["npuserve:generation_tokens_total", {}, tokens]]}]}
    out = render(reply(300), previous=(10.0, reply(100)), now=12.0)
    assert "generated 300 (100.0/s)" in out
    held = reply(0)
    held["metrics"].append({"name": "npuserve:admission_blocked", "type": "gauge", "help": "",
                            "samples": [["npuserve:admission_blocked", {"reason": "kv"}, 1.0],
                                        ["npuserve:admission_blocked", {"reason": "max_sequences"}, 0.0]]})
    assert "waiting 0 (held by kv)" in render(held)


def test_a_reply_without_metrics_is_shown_as_details_only():
    assert format_report({"balancer": {"boards": 2}}) == "balancer.boards  2"


@pytest.mark.integration
def test_stats_renders_the_metrics_dashboard(daemon):
    d = daemon(backend="stub", chips=2)
    # the start-up load's warm-up requests ran through the scheduler before any client came: count from them
    before = npuserve("stats", "--endpoint", d.endpoint).stdout
    with d.client(timeout=30) as c:
        for i in range(4):
            c.generate([1, 2, 3], max_tokens=5, seed=i)
    r = npuserve("stats", "--endpoint", d.endpoint)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "success 4 (length 4)" in out
    def figure(text: str, name: str) -> int:
        return int(re.search(rf"\b{name} (\d+)", text).group(1))

    assert figure(out, "generated") - figure(before, "generated") == 20
    assert figure(out, "prompt") - figure(before, "prompt") == 12
    assert figure(out, "accepted") - figure(before, "accepted") == 4
    for heading in ("latency", "queues (depth / oldest wait)", "decode batches", "kv cache", "chips", "details"):
        assert heading in out, heading
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("end to end"))
    assert line.split()[3] == "4"  # the e2e histogram counted the 4 requests
    s = orjson.loads(npuserve("stats", "--endpoint", d.endpoint, "--json").stdout)
    names = {f["name"] for f in s["metrics"]}
    assert {"npuserve:e2e_request_latency_seconds", "npuserve:queue_depth", "npuserve:kv_blocks"} <= names


@pytest.mark.integration
def test_top_refreshes_with_rates_and_exits_on_ctrl_c(daemon):
    d = daemon(backend="stub", chips=1)
    with d.client(timeout=30) as c:
        c.generate([1, 2, 3], max_tokens=5)
    r = npuserve("top", d.endpoint, "--iterations", "2", "--interval", "0.2")
    assert r.returncode == 0, r.stderr
    frames = r.stdout.split("-" * 40)
    assert len(frames) == 2 and all("latency" in f and "decode batches" in f for f in frames)
    assert "/s)" not in frames[0] and "/s)" in frames[1]  # rates need a previous frame

    # in a terminal: it clears and redraws until Ctrl-C, then exits 0
    master, slave = pty.openpty()
    proc = subprocess.Popen([*NPUSERVE, "top", d.endpoint, "--interval", "0.2"], cwd=ROOT, stdin=slave,
                            stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while seen.count(b"\x1b[2J") < 2 and time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        assert seen.count(b"\x1b[2J") >= 2, seen[-2000:]
        proc.send_signal(signal.SIGINT)
        # keep reading: a frame written after the signal must not block `top` on a full terminal buffer
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    os.read(master, 65536)
                except OSError:
                    pass
        assert proc.wait(5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_top_says_what_to_do_when_the_daemon_is_down(short_dir):
    r = npuserve("top", f"ipc://{short_dir}/none.sock", "--iterations", "1", "--timeout", "0.3")
    assert r.returncode == 2
    assert "no answer from" in r.stdout and "npuserve serve" in r.stdout
