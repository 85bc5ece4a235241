"""Promises of docs/serving.md and docs/protocol.md checked on a real daemon.

Where a fault cannot be provoked from outside (a bug in the core, a worker
slow to start), the daemon process runs a short `prelude` before its main()
that injects it; everything else is the real daemon, workers and sockets.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import time

import orjson
import psutil
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from daemon_procs import shm_objects_of
from waiting import wait_until
from engine.errors import ServerError, Unavailable

pytestmark = pytest.mark.integration

SLOW = {"decode_base_ms": 5.0, "decode_per_lane_ms": 0.0}  # sim backend: a decode step takes 5 ms

# Prompt [666, ...] makes Scheduler.submit raise (a bug met while handling one
# request); prompt [667, ...] arms a bug in the next Scheduler.tick (a bug in
# the loop itself).
CORE_BUG = """
import engine.core.scheduler as _s
_submit, _tick, _armed = _s.Scheduler.submit, _s.Scheduler.tick, []
def _bad_submit(self, rid, params, now):
    if params.prompt[:1] == [666]:
        raise RuntimeError("injected core bug")
    if params.prompt[:1] == [667]:
        _armed.append(1)
    return _submit(self, rid, params, now)
def _bad_tick(self, now):
    if _armed:
        raise RuntimeError("injected loop bug")
    return _tick(self, now)
_s.Scheduler.submit, _s.Scheduler.tick = _bad_submit, _bad_tick
"""


def _raw(endpoint: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return ctx, s


def _events_until_terminal(s: zmq.Socket, ids: set[str], timeout: float = 30.0) -> dict[str, list[dict]]:
    got: dict[str, list[dict]] = {i: [] for i in ids}
    deadline = time.monotonic() + timeout
    while not all(evs and evs[-1]["ev"] in ("done", "error") for evs in got.values()):
        left = deadline - time.monotonic()
        assert left > 0, f"no terminal event within {timeout} s: {got}"
        if s.poll(int(min(left, 0.2) * 1000)):
            ev = orjson.loads(s.recv())
            got.setdefault(ev["id"], []).append(ev)
    return got


def test_a_core_bug_costs_its_request_a_500_and_the_daemon_keeps_serving(daemon):
    d = daemon(backend="stub", chips=1, prelude=CORE_BUG)
    with d.client(timeout=10) as c:
        with pytest.raises(ServerError) as e:
            c.generate([666, 1], max_tokens=3)
        assert (e.value.code, e.value.reason) == (500, "internal")
        assert c.generate([1, 2], max_tokens=3).finish_reason == "length"
        assert c.health()["ok"] is True
    assert "injected core bug" in d.log()


def test_a_loop_bug_ends_every_open_request_with_500_internal_and_exits_4(daemon):
    # vocab_size 1000: the trip prompt [667] is a valid request, admitted (and open) when the loop bug hits
    d = daemon(backend="sim", chips=1, backend_options={**SLOW, "vocab_size": 1000}, prelude=CORE_BUG)
    d.expect_exit = 4
    ctx, s = _raw(d.endpoint)
    try:
        s.send(orjson.dumps({"v": 1, "op": "generate", "id": "long", "prompt": [1, 2], "max_tokens": 1000}))
        assert s.poll(10_000), "the long stream never started"
        first = orjson.loads(s.recv())
        assert first["ev"] == "tokens" and first["id"] == "long", first
        s.send(orjson.dumps({"v": 1, "op": "generate", "id": "trip", "prompt": [667], "max_tokens": 3}))
        got = _events_until_terminal(s, {"long", "trip"})
    finally:
        s.close(0)
        ctx.term()
    for rid in ("long", "trip"):
        last = got[rid][-1]
        assert (last["ev"], last["code"], last["reason"]) == ("error", 500, "internal"), (rid, last)
    assert d.proc.wait(30) == 4
    assert "injected loop bug" in d.log()


def test_an_ipc_endpoint_held_by_a_live_daemon_is_refused(daemon):
    first = daemon(backend="stub", chips=1)
    second = daemon(backend="stub", chips=1, extra=["--endpoint", first.endpoint], wait=False)
    second.expect_exit = 1
    assert second.proc.wait(60) == 1
    assert "in use by another running daemon" in second.log()
    with first.client(timeout=10) as c:  # the first one is untouched
        assert c.generate([1, 2], max_tokens=2).finish_reason == "length"


def test_a_stale_socket_file_is_removed_and_the_endpoint_served(daemon, short_dir):
    path = os.path.join(short_dir, "stale.sock")
    so = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    so.bind(path)  # the file of a listener that died without unlinking it
    so.close()
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    d = daemon(backend="stub", chips=1, extra=["--endpoint", f"ipc://{path}"])
    from engine.client import Client

    with Client(f"ipc://{path}", timeout=10) as c:
        assert c.generate([1, 2], max_tokens=2).finish_reason == "length"
    assert d.proc.poll() is None


# Plants a segment whose owner is dead just before the real start-up reap_stale
# runs (so no other daemon on the machine can reap it first), and records what
# that call removed.
PLANT_STALE = """
import os as _os, engine.daemon.daemon as _daemon
from ipc.shm import Segment as _Segment
_reap = _daemon.reap_stale
def _planting_reap(prefix):
    r, w = _os.pipe()
    pid = _os.fork()
    if pid == 0:
        seg = _Segment.create(prefix, "stale", 4096, "planted")
        _os.write(w, seg.name.encode())
        _os._exit(0)  # dies without unlinking: a stale segment
    _os.close(w)
    name = _os.read(r, 200).decode()
    _os.waitpid(pid, 0)
    removed = _reap(prefix)
    with open(_os.environ["NPS_PLANTED"], "w") as fh:
        fh.write(name + "\\n" + "\\n".join(removed))
    return removed
_daemon.reap_stale = _planting_reap
"""


def test_start_up_reaps_shared_memory_of_dead_owners(daemon, short_dir, monkeypatch):
    report = os.path.join(short_dir, "planted")
    monkeypatch.setenv("NPS_PLANTED", report)
    d = daemon(backend="stub", chips=1, prelude=PLANT_STALE)
    planted, *removed = open(report).read().split("\n")
    assert planted.startswith("/npuserve-stale-") and planted in removed
    assert not os.path.exists("/dev/shm" + planted)
    assert '"reaped_stale_shm"' in d.log()
    assert shm_objects_of(d.pid), "the daemon's own rings were reaped too"


# Workers that take a minute to start: the daemon is still starting up.
SLOW_WORKERS = """
import subprocess as _sp, engine.daemon.chip_link as _cl
class _SlowPopen(_sp.Popen):
    def __init__(self, args, *a, **kw):
        if list(args[1:3]) == ["-m", "workers"]:
            args = [args[0], "-c", "import sys, time; time.sleep(60); from workers.main import main; "
                    "sys.exit(main(sys.argv[1:]))"] + list(args[3:])
        super().__init__(args, *a, **kw)
_cl.subprocess = type("_M", (), {"Popen": _SlowPopen, "TimeoutExpired": _sp.TimeoutExpired,
                                 "DEVNULL": _sp.DEVNULL})
"""


def test_sigterm_during_start_up_exits_0_and_leaves_nothing(daemon):
    d = daemon(backend="stub", chips=2, prelude=SLOW_WORKERS, wait=False)
    wait_until(lambda: len(psutil.Process(d.pid).children()) == 2, 60, what="both workers spawned")
    d.remember_children()
    assert "serving" not in d.log()  # still waiting for READY
    assert d.stop(signal.SIGTERM) == 0
    assert '"serving"' not in d.log()
    # the fixture asserts: exit 0, no shared memory of the daemon, no worker left


def test_health_reports_the_loop_on_a_real_daemon(daemon):
    stall = """
import time as _t, engine.core.scheduler as _s
_submit = _s.Scheduler.submit
def _slow_submit(self, rid, params, now):
    if params.prompt[:1] == [300]:
        _t.sleep(1.0)  # a loop turn far over server.loop_stall_ms
    return _submit(self, rid, params, now)
_s.Scheduler.submit = _slow_submit
"""
    d = daemon(backend="stub", chips=1, prelude=stall, settings={"server.loop_stall_ms": 300})
    with d.client(timeout=10) as c:
        # Right after start-up a loaded machine may have stalled the loop past 300 ms already (and a
        # stall counts for 5 s): wait for a healthy loop instead of assuming one.
        healthy = {}
        wait_until(lambda: healthy.update(c.health()) or (healthy["loop_ok"] is True and healthy["ok"] is True
                                                          and 0 <= healthy["loop_lag_ms"] < 300),
                   timeout=30, interval=0.2, what="a healthy loop (loop_ok, loop_lag_ms < 300)")
        c.generate([300], max_tokens=1)
        h = c.health()
    assert h["loop_ok"] is False and h["ok"] is False  # a stall a moment ago still counts (5 s window)
    assert h["loop_lag_ms"] >= 1000


def test_a_frame_over_the_hard_size_limit_drops_that_connection_only(daemon):
    d = daemon(backend="stub", chips=1, settings={"server.max_message_bytes": 1024})  # hard limit 16 KiB
    ctx, s = _raw(d.endpoint)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        s.send(orjson.dumps({"v": 1, "op": "health", "id": "h"}))
        assert s.poll(10_000) and orjson.loads(s.recv())["ev"] == "health"  # connected and served
        s.send(b"x" * (20 << 10))
        assert mon.poll(10_000), "the daemon kept a connection that sent a 20 KiB frame"
        ev = recv_monitor_message(mon)
        assert ev["event"] == zmq.EVENT_DISCONNECTED
        with d.client(timeout=10) as c:  # everyone else is served as before
            assert c.generate([1, 2], max_tokens=2).finish_reason == "length"
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)
        ctx.term()


def test_drain_lets_in_flight_requests_finish(daemon):
    d = daemon(backend="sim", chips=1, backend_options=SLOW)
    with d.client(timeout=30) as c:
        stream = c.stream([1, 2, 3], max_tokens=200, seed=3)
        first = next(stream)
        assert c.call("drain") == {"accepting": False}
        with pytest.raises(Unavailable):
            c.generate([4, 5], max_tokens=2)
        rest = [t for chunk in stream for t in chunk]
        assert len(first) + len(rest) == 200
        c.call("resume")
        whole = c.generate([1, 2, 3], max_tokens=200, seed=3)
    assert first + rest == whole.tokens


def test_socket_is_0600_in_a_0700_directory_whatever_the_umask(daemon, short_dir):
    fresh = os.path.join(short_dir, "fresh")
    path = os.path.join(fresh, "board.sock")
    d = daemon(backend="stub", chips=1, prelude="import os as _os\n_os.umask(0)\n",
               extra=["--runtime-dir", fresh, "--endpoint", f"ipc://{path}"])
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert d.proc.poll() is None


def test_drain_timeout_ends_what_is_still_in_flight_and_resume_admits_again(daemon):
    # 60,000 tokens take five minutes: the stream is still in flight when the drain's 100 ms run out, at any speed
    d = daemon(backend="sim", chips=1, backend_options={**SLOW, "max_seq": 65536})
    with d.client(timeout=30) as c:
        stream = c.stream([1, 2, 3], max_tokens=60_000, seed=3)
        first = next(stream)
        assert c.call("drain", timeout_ms=100) == {"accepting": False}
        with pytest.raises(Unavailable) as ended:
            for _ in stream:
                pass
        assert ended.value.reason == "shutdown" and ended.value.retryable
        with pytest.raises(Unavailable):
            c.generate([4, 5], max_tokens=2)
        c.call("resume")
        assert c.generate([1, 2, 3], max_tokens=2, seed=3).finish_reason == "length"
