"""ChipLink lifecycle and the control-message codec it speaks with its worker."""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import tempfile
import time

import numpy as np
import orjson
import psutil
import pytest
import zmq

from ipc.records import Job, JobKind
from ipc.ring import RingFull
from engine.daemon.chip_link import ChipLink, Heartbeat, Ready, Result, WorkerFailed
from workers.control import (BLAS_THREAD_VARS, ControlError, Msg, WorkerConfig, decode, encode,
                             worker_environ)

_boards = itertools.count()


# -- control codec ----------------------------------------------------------------

def test_every_message_round_trips():
    samples = {
        Msg.JOB: {}, Msg.SHUTDOWN: {}, Msg.BYE: {},
        Msg.CHAOS: {"action": "hang", "seconds": 1.5},
        Msg.RELEASE: {"blocks": [3, 0, 17]},
        Msg.READY: {"info": {"name": "stub"}, "pid": 42},
        Msg.FAILED: {"message": "no such backend"},
        Msg.HEARTBEAT: {"at": 12.5, "jobs_done": 7},
        Msg.RESULT: {"job_id": 9},
        Msg.KV_POOL: {"name": "/npuserve-0-1-kvh00", "slots": 4, "slot_bytes": 256, "disk_dir": None},
        Msg.LORA_ADD: {"id": 3, "path": "/srv/adapters/a1", "sha256": "ab" * 32},
        Msg.LORA_DROP: {"id": 3},
    }
    assert set(samples) == set(Msg)
    for kind, fields in samples.items():
        got_kind, msg = decode(encode(kind, **fields))
        assert got_kind is kind
        assert {k: msg[k] for k in fields} == fields
        assert msg["v"] == 1


@pytest.mark.parametrize("data", [
    b"not json",
    b"[1, 2]",
    orjson.dumps({"msg": "job"}),  # no version
    orjson.dumps({"v": 2, "msg": "job"}),
    orjson.dumps({"v": 1, "msg": "teleport"}),
    orjson.dumps({"v": 1, "msg": "heartbeat", "at": 1.0}),  # lacks jobs_done
    orjson.dumps({"v": 1, "msg": "chaos", "action": "explode", "seconds": 0}),
    orjson.dumps({"v": 1, "msg": "release"}),  # no blocks
    orjson.dumps({"v": 1, "msg": "release", "blocks": [1, -2]}),
    orjson.dumps({"v": 1, "msg": "release", "blocks": "1,2"}),
    orjson.dumps({"v": 1, "msg": "lora_add", "id": -1, "path": "/a", "sha256": "x"}),
    orjson.dumps({"v": 1, "msg": "lora_add", "id": 1, "path": 7, "sha256": "x"}),
    orjson.dumps({"v": 1, "msg": "lora_drop"}),  # no id
])
def test_malformed_messages_raise_control_error(data):
    with pytest.raises(ControlError):
        decode(data)


def test_encode_refuses_a_message_missing_fields():
    with pytest.raises(AssertionError):
        encode(Msg.READY, pid=1)


def test_worker_config_round_trips_through_json():
    cfg = WorkerConfig(board="b0", chip=3, backend="ref", job_ring="/a", result_ring="/b",
                       control_endpoint="ipc:///tmp/x.sock", parent_pid=1234,
                       backend_options={"num_blocks": 64}, package_path="/pkg", heartbeat_interval_s=0.1,
                       result_bell_fd=7)
    assert WorkerConfig.from_json(cfg.to_json()) == cfg


def test_worker_environ_gives_one_blas_thread_unless_the_operator_chose():
    base = {"PATH": "/bin"}
    assert worker_environ(base) == {"PATH": "/bin", **{v: "1" for v in BLAS_THREAD_VARS}}
    chosen = {"PATH": "/bin", "OMP_NUM_THREADS": "4"}
    assert worker_environ(chosen) == chosen  # an explicit choice is passed on untouched
    forced = {"OPENBLAS_NUM_THREADS": "8", "NPUSERVE_WORKER_BLAS_THREADS": "2"}
    assert {v: worker_environ(forced)[v] for v in BLAS_THREAD_VARS} == {v: "2" for v in BLAS_THREAD_VARS}
    with pytest.raises(ValueError):
        worker_environ({"NPUSERVE_WORKER_BLAS_THREADS": "0"})


# -- ChipLink lifecycle -------------------------------------------------------------

def shm_entries(board: str) -> set[str]:
    return {e for e in os.listdir("/dev/shm") if f"-{board}-" in e}


@pytest.fixture
def env():
    board = f"lt{os.getpid()}n{next(_boards)}"
    runtime_dir = tempfile.mkdtemp(prefix="nl", dir="/tmp")
    ctx = zmq.Context()
    yield ctx, board, runtime_dir
    ctx.term()
    leftovers = os.listdir(runtime_dir)
    shutil.rmtree(runtime_dir, ignore_errors=True)
    assert shm_entries(board) == set(), "shared memory outlived the test"
    assert leftovers == [], f"runtime files left behind: {leftovers}"


def link_for(env, **kw) -> ChipLink:
    ctx, board, runtime_dir = env
    kw.setdefault("backend", "stub")
    return ChipLink(ctx=ctx, board=board, chip=1, runtime_dir=runtime_dir, heartbeat_interval_s=0.05, **kw)


def events_until(link: ChipLink, until, timeout: float = 20.0) -> list:
    events: list = []
    deadline = time.monotonic() + timeout
    while not until(events):
        assert time.monotonic() < deadline, f"timed out; events: {events[-5:]}"
        if link.socket is not None:
            poller = zmq.Poller()
            poller.register(link.socket, zmq.POLLIN)
            poller.register(link.result_fd, zmq.POLLIN)
            poller.poll(50)
        else:
            time.sleep(0.05)
        events.extend(link.handle_events())
    return events


def events_during(link: ChipLink, seconds: float) -> list:
    """Everything the link reports while it is polled for `seconds` (to assert that nothing more comes)."""
    events: list = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if link.socket is not None:
            poller = zmq.Poller()
            poller.register(link.socket, zmq.POLLIN)
            poller.register(link.result_fd, zmq.POLLIN)
            poller.poll(int(min(left, 0.05) * 1000) + 1)
        else:
            time.sleep(min(left, 0.05))
        events.extend(link.handle_events())
    return events


def has(kind):
    return lambda events: any(isinstance(e, kind) for e in events)


def one_decode(job_id: int) -> Job:
    return Job(job_id=job_id, generation=0, kind=JobKind.DECODE, tokens=np.array([1], np.int32),
               positions=np.array([4], np.int32), query_start=np.array([0, 1], np.int32),
               lane_valid=np.ones(1, np.uint8), context_lens=np.array([5], np.int32),
               block_tables=np.zeros((1, 1), np.int32), sample=np.ones(1, np.uint8),
               temperature=np.zeros(1, np.float32), top_p=np.ones(1, np.float32), top_k=np.zeros(1, np.int32),
               seed=np.array([11], np.uint64), want_logprobs=np.zeros(1, np.uint8))


def test_start_reports_ready_with_the_backend_info_and_private_resources(env):
    link = link_for(env, backend_options={"vocab_size": 500})
    try:
        link.start()
        events = events_until(link, has(Ready))
        ready = next(e for e in events if isinstance(e, Ready))
        assert ready.pid == link.pid and link.info is ready.info
        assert ready.info.name == "stub" and ready.info.vocab_size == 500
        entries = shm_entries(env[1])
        assert len([e for e in entries if not e.startswith("sem.")]) == 2  # job ring and result ring
        assert len([e for e in entries if e.startswith("sem.")]) == 1  # the job doorbell
        for e in entries:
            assert stat.S_IMODE(os.stat(f"/dev/shm/{e}").st_mode) == 0o600
        (sock_file,) = os.listdir(env[2])
        assert stat.S_IMODE(os.stat(os.path.join(env[2], sock_file)).st_mode) == 0o600
    finally:
        link.stop()
    assert link.pid is None and link.socket is None and not link.is_alive()


def test_the_worker_process_starts_with_one_blas_thread(env, monkeypatch):
    for var in (*BLAS_THREAD_VARS, "NPUSERVE_WORKER_BLAS_THREADS"):
        monkeypatch.delenv(var, raising=False)
    with link_for(env) as link:
        events_until(link, has(Ready))
        environ = psutil.Process(link.pid).environ()
    assert {v: environ.get(v) for v in BLAS_THREAD_VARS} == {v: "1" for v in BLAS_THREAD_VARS}


def test_heartbeats_report_jobs_done(env):
    with link_for(env) as link:
        events_until(link, has(Ready))
        link.submit(one_decode(1))
        link.submit(one_decode(2))
        events = events_until(link, lambda ev: any(isinstance(e, Heartbeat) and e.jobs_done == 2 for e in ev))
        assert sorted(e.result.job_id for e in events if isinstance(e, Result)) == [1, 2]
        assert link.last_heartbeat > 0


def test_stop_is_safe_before_start_and_twice(env):
    link = link_for(env)
    link.stop()
    link.start()
    link.stop()
    link.stop()


def test_restart_gives_a_new_worker_and_fresh_rings(env):
    link = link_for(env)
    try:
        link.start()
        events_until(link, has(Ready))
        first_pid, first_rings = link.pid, shm_entries(env[1])
        link.restart()
        assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE
        events_until(link, has(Ready))
        assert link.pid != first_pid
        second_rings = shm_entries(env[1])
        assert len(second_rings) == 3 and not (second_rings & first_rings)  # 2 rings + doorbell
        link.submit(one_decode(5))
        events = events_until(link, has(Result))
        assert [e.result.job_id for e in events if isinstance(e, Result)] == [5]
    finally:
        link.stop()


def test_submit_raises_ring_full_when_the_worker_does_not_drain(env):
    link = link_for(env, ring_bytes=8 << 10)
    try:
        link.start()
        events_until(link, has(Ready))
        link.chaos("hang", 30.0)
        with pytest.raises(RingFull):
            for i in range(1000):  # a B=1 decode record is ~0.8 KiB: the 8 KiB ring fills quickly
                link.submit(one_decode(i))
        assert 2 <= i < 20
    finally:
        link.stop(timeout=0.2)  # a hung worker ignores SHUTDOWN: stop escalates to signals


def test_worker_dying_before_ready_is_reported_as_failed(env):
    link = link_for(env)
    try:
        link.start()
        link.kill()  # long before the fresh interpreter could have imported numpy
        events = events_until(link, has(WorkerFailed))
        assert not any(isinstance(e, Ready) for e in events)
        assert "before it was ready" in next(e for e in events if isinstance(e, WorkerFailed)).message
        assert events_during(link, 1.0) == []  # reported once only
    finally:
        link.stop()


def test_a_release_to_a_worker_that_died_unnoticed_reports_it_failed_instead_of_raising(env):
    # The daemon frees a request's blocks on the loop, before its supervisor has seen the worker's death:
    # the send finds no peer. It used to raise zmq.Again out of the loop and stop the whole board.
    link = link_for(env)
    try:
        link.start()
        events_until(link, has(Ready))
        link.kill()
        psutil.Process(link.pid).wait(30)
        events: list = []
        deadline = time.monotonic() + 30
        while not has(WorkerFailed)(events):  # until zmq has seen the peer go and the send finds no pipe
            assert time.monotonic() < deadline, f"no failure reported; events: {events[-5:]}"
            link.release_blocks([3, 4])
            events += link.handle_events()
            time.sleep(0.01)
        assert "took no control message" in next(e for e in events if isinstance(e, WorkerFailed)).message
        link.release_blocks([5])
        assert events_during(link, 0.2) == []  # reported once only
        link.restart()
        events_until(link, has(Ready))  # a restarted link sends again
        link.release_blocks([1])
        link.submit(one_decode(7))
        assert [e.result.job_id for e in events_until(link, has(Result)) if isinstance(e, Result)] == [7]
    finally:
        link.stop()


def test_runtime_dir_too_long_for_a_socket_path_fails_cleanly(env):
    ctx, board, runtime_dir = env
    deep = os.path.join(runtime_dir, "d" * 120)
    link = ChipLink(ctx=ctx, board=board, chip=0, backend="stub", runtime_dir=deep)
    with pytest.raises(ValueError, match="too long"):
        link.start()
    assert shm_entries(board) == set() and not link.is_alive()


def _worker_config(pid: int) -> dict:
    """The WorkerConfig a worker was started with (its last argument, JSON)."""
    return orjson.loads(psutil.Process(pid).cmdline()[-1])


def test_the_worker_polls_for_jobs_as_long_as_the_link_says(env):
    with link_for(env, job_spin_s=0.0) as link:
        events_until(link, has(Ready))
        assert _worker_config(link.pid)["job_spin_s"] == 0.0
    with link_for(env) as link:  # not given: the worker's own default
        events_until(link, has(Ready))
        assert _worker_config(link.pid)["job_spin_s"] == WorkerConfig.job_spin_s == 200e-6
