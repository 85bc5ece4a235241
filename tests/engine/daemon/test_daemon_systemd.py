"""The daemon under a test-owned NOTIFY_SOCKET: READY, STATUS, WATCHDOG, STOPPING; a stalled loop; start-up failures."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import pytest

from daemon_procs import shm_objects_of
from repo_root import ROOT
from waiting import log_events, wait_for_log

pytestmark = pytest.mark.integration

WATCHDOG_ENV = {"WATCHDOG_USEC": "1000000"}  # systemd's WatchdogSec=1: a ping every 0.5 s


@pytest.mark.parametrize("abstract", [False, True], ids=["plain", "abstract"])
def test_ready_status_watchdog_and_stopping_reach_the_notify_socket(daemon, notify_listener, abstract):
    n = notify_listener(abstract=abstract)
    period_s = 2.0  # WatchdogSec=2: a ping every second, so a loop turn late by up to a second still passes
    d = daemon(backend="stub", chips=2, wait=False,
               env={"NOTIFY_SOCKET": n.address, "WATCHDOG_USEC": str(int(period_s * 1e6))})
    ready = n.wait_for("READY", "1")
    # READY=1 means warm and bound: the endpoint answers at once, every chip up
    h = d.health(timeout=5)
    assert h["chips_up"] == 2 and h["ok"], h
    assert ready["STATUS"].startswith("serving model 'tiny'") and "2/2 chips up" in ready["STATUS"]
    assert ready["MAINPID"] == str(d.pid)
    t_ready = n.times("READY", "1")[0]
    # while the workers loaded, systemd's start timeout was extended past the daemon's own start-up limit
    [(t_ext, loading)] = [(t, m) for t, m in n.snapshot() if "EXTEND_TIMEOUT_USEC" in m][:1]
    assert t_ext <= t_ready and loading["STATUS"].startswith("starting: loading the model on 2 chip workers")
    assert int(loading["EXTEND_TIMEOUT_USEC"]) > 120_000_000
    n.wait_for("WATCHDOG", "1", after=t_ready + 1.5 * period_s, timeout=30)
    pings = [t for t in n.times("WATCHDOG", "1") if t > t_ready]
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert len(pings) >= 3, pings
    assert min(gaps) >= 0.4 * period_s, gaps  # paced at half of WATCHDOG_USEC, never a burst
    assert statistics.median(gaps) <= period_s, gaps  # inside systemd's period
    with d.client(timeout=10) as c:
        c.generate([1, 2], max_tokens=2)
    t_term = time.monotonic()
    assert d.stop(signal.SIGTERM) == 0
    stopping = n.wait_for("STOPPING", "1", after=t_term, timeout=5)
    assert stopping["STATUS"].startswith("draining: 0 requests in flight")
    assert int(stopping["EXTEND_TIMEOUT_USEC"]) == (30 + 15) * 1_000_000  # drain budget + stop grace
    n.wait_for("STATUS", "stopping: drain ended (drained)", after=t_term, timeout=5)
    assert shm_objects_of(d.pid) == []
    events = [e["event"] for e in log_events(d.log())]
    assert events.index("serving") < events.index("drain_started") < events.index("stopped")
    assert "npuserve: board" not in d.log()  # no banner under systemd: STATUS says it


def test_a_stalled_loop_stops_the_watchdog_pings(daemon, notify_listener):
    n = notify_listener()
    stall_s = 4.0
    d = daemon(backend="stub", chips=1, wait=False,
               env={"NOTIFY_SOCKET": n.address, **WATCHDOG_ENV, "NPUSERVE_TEST_HOOKS": "1",
                    "NPUSERVE_TEST_STALL_S": str(stall_s)})
    n.wait_for("READY", "1")
    n.wait_for("WATCHDOG", "1", after=n.times("READY", "1")[0] + 1.0, timeout=30)
    t_sig = time.monotonic()
    d.proc.send_signal(signal.SIGUSR1)  # the test hook: the loop sleeps stall_s inside its turn
    # However late the loop takes the signal up, the stall is a silence between two pings (the one after it:
    # the pings resume): a ping every 0.5 s while the loop turns, none for stall_s while it does not. Only a
    # lower bound on time, which a machine's speed does not break.
    deadline = time.monotonic() + 60  # a hang guard only

    def gaps() -> list[float]:
        pings = n.times("WATCHDOG", "1")
        pings = pings[max(0, len([t for t in pings if t < t_sig]) - 1):]  # from the last one before the signal
        return [b - a for a, b in zip(pings, pings[1:])]

    while not any(g >= 0.75 * stall_s for g in gaps()):
        assert time.monotonic() < deadline, f"pings kept coming while the loop was stalled: gaps {gaps()}"
        time.sleep(0.05)
    assert wait_for_log(d, "test_hook_stall")[0]["seconds"] == stall_s
    assert d.stop() == 0


def _flush(n) -> None:
    """Until the listener has read a datagram sent now: one the daemon sent before it (the socket keeps
    their order) is in its messages, however slowly its thread runs."""
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    addr = b"\0" + n.address[1:].encode() if n.address.startswith("@") else n.address
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(f"TEST_BARRIER={mark}".encode(), addr)
    n.wait_for("TEST_BARRIER", mark, timeout=60)


def _start_failure(args: list[str], notify: str, timeout: float = 120) -> tuple[int, list[dict], str]:
    cmd = [sys.executable, "-m", "engine.daemon.main", "--backend", "stub", "--chips", "1", *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=timeout,
                       env={**os.environ, "NOTIFY_SOCKET": notify})
    text = (p.stdout + p.stderr).decode(errors="replace")
    return p.returncode, log_events(text), text


def test_a_busy_endpoint_fails_start_up_with_one_line_before_ready(short_dir, notify_listener):
    n = notify_listener()
    path = os.path.join(short_dir, "busy.sock")
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(path)
    other.listen(1)
    try:
        rc, events, text = _start_failure(["--endpoint", f"ipc://{path}", "--runtime-dir", short_dir], n.address)
    finally:
        other.close()
    assert rc == 1, text
    failed = [e for e in events if e["event"] == "startup_failed"]
    assert len(failed) == 1 and failed[0]["exit_code"] == 1, text
    assert path in failed[0]["message"] and "in use" in failed[0]["message"]
    _flush(n)
    assert n.times("READY") == [], n.snapshot()
    assert "Traceback" not in text


def test_a_bad_config_fails_start_up_with_one_line_naming_the_key(short_dir, notify_listener):
    n = notify_listener()
    cfg = os.path.join(short_dir, "bad.toml")
    with open(cfg, "w") as fh:
        fh.write('schema = "npuserve/v1"\n[admission]\nmax_sequences = 0\n')
    rc, events, text = _start_failure(["--config", cfg, "--runtime-dir", short_dir], n.address)
    assert rc == 2, text
    [failed] = [e for e in events if e["event"] == "startup_failed"]
    assert failed["errors"] == ["admission.max_sequences: must be an int >= 1, got 0"]
    assert failed["level"] == "error" and "configuration error" in failed["message"]
    assert n.times("READY") == []
