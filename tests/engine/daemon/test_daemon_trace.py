"""`npuserve serve --trace FILE`: valid Chrome trace JSON with a span for every job and request phase."""

from __future__ import annotations

import json
import os
import threading
from collections import defaultdict

import pytest

from engine.core.actions import FailRequest, FinishRequest, SubmitJob
from engine.daemon.observability.trace import TraceWriter
from engine.errors import InvalidRequest
from ipc.records import JobKind, JobResult, JobStatus

PHASES = {"M", "X", "b", "e", "i"}


def check_chrome_trace(events: list) -> None:
    """The fields the Chrome trace event format requires, per phase."""
    assert isinstance(events, list) and events
    for ev in events:
        assert ev["ph"] in PHASES, ev
        assert isinstance(ev["name"], str) and isinstance(ev["pid"], int), ev
        if ev["ph"] == "M":
            assert isinstance(ev["args"], dict) and "tid" in ev
            continue
        assert isinstance(ev["ts"], int) and ev["ts"] >= 0 and isinstance(ev["tid"], int), ev
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], int) and ev["dur"] >= 0 and isinstance(ev["tid"], int), ev
        if ev["ph"] in "be":
            assert ev["cat"] and ev["id"], ev


@pytest.mark.integration
def test_trace_has_every_job_and_request_phase(daemon, short_dir):
    path = os.path.join(short_dir, "trace.json")
    d = daemon(backend="stub", chips=2, settings={"executor.max_inflight": 2}, extra=["--trace", path])
    done = []

    def run(k: int) -> None:
        with d.client(timeout=30) as c:
            for i in range(3):
                done.append(c.generate([1 + k, 2, 3, 4][: 2 + i], max_tokens=6 + i, seed=k * 10 + i))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with pytest.raises(InvalidRequest):
        d.client(timeout=10).generate([1, 100000], max_tokens=2)
    stats = d.client(timeout=10).stats()
    assert d.stop() == 0
    with open(path) as fh:
        events = json.load(fh)
    check_chrome_trace(events)

    jobs = [e for e in events if e["ph"] == "X" and e["name"] in ("prefill", "decode")]
    assert len(jobs) == stats["daemon"]["jobs_submitted"] == stats["daemon"]["results"]
    assert len({j["args"]["job"] for j in jobs}) == len(jobs)
    for j in jobs:
        a = j["args"]
        assert a["status"] == "ok" and 1 <= a["lanes"] == len(a["requests"]) <= a["batch"]
        assert j["tid"] >= 100
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {names[j["tid"]].rsplit(" slot", 1)[0] for j in jobs} <= {"chip 0", "chip 1"}
    assert names[1] == "scheduler loop"
    # the workers' own record of the device calls and the gaps between them: how busy each chip is kept
    device = [e for e in events if e["ph"] == "X" and e["name"] in ("device prefill", "device decode")]
    assert len(device) == len(jobs) and {names[e["tid"]] for e in device} == {"chip 0 device", "chip 1 device"}
    assert any(e["name"] == "idle" and e["args"]["gap_us"] >= 0 for e in events)
    assert any(e["name"] == "turn" and e["ph"] == "X" for e in events)

    by_req: dict[str, list] = defaultdict(list)
    for e in events:
        if e["ph"] in "be":
            by_req[e["id"]].append(e)
    assert len(done) == 12
    assert len(by_req) == len(done) + 2  # and the start-up load's warm-up requests, one per chip
    for rid, evs in by_req.items():
        stack, spans = [], {}
        for e in evs:  # written chronologically: b/e must nest as a stack
            if e["ph"] == "b":
                stack.append(e)
            else:
                b = stack.pop()
                assert b["name"] == e["name"] and e["ts"] >= b["ts"]
                spans[e["name"]] = (b["ts"], e["ts"])
        assert not stack
        assert set(spans) == {"request", "queued", "prefill", "decode"}, rid
        r0, r1 = spans["request"]
        assert r0 == spans["queued"][0] and spans["queued"][1] == spans["prefill"][0]
        assert spans["prefill"][1] == spans["decode"][0] and spans["decode"][1] == r1
    # every lane of every job belongs to a traced request
    traced = {e["args"]["request"] for evs in by_req.values() for e in evs if e["name"] == "request" and e["ph"] == "b"}
    assert {r for j in jobs for r in j["args"]["requests"]} == traced
    assert [e["args"]["reason"] for e in events if e["name"] == "rejected"] == ["token_out_of_range"]


def _job(job_id: int, kind: JobKind = JobKind.DECODE):
    from ipc.records import Lane, build_job

    lane = Lane(tokens=[1], start=0, block_table=[0], sample=True, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                want_logprobs=False)
    return build_job(kind, [lane], job_id=job_id, generation=1, batch=1, table_width=1)


def _result(job_id: int) -> JobResult:
    import numpy as np

    return JobResult(job_id=job_id, generation=1, kind=JobKind.DECODE, status=JobStatus.OK,
                     tokens=np.zeros(1, np.int32), logprobs=np.zeros(1, np.float32), device_us=100, worker_us=200)


def test_trace_is_bounded_and_stays_valid(tmp_path):
    path = str(tmp_path / "t.json")
    tw = TraceWriter(path, board="b", pid=7, max_events=20)
    for i in range(100):
        tw.turn(i * 0.001, i * 0.001 + 0.0005, 1, 0)
    tw.close()
    with open(path) as fh:
        events = json.load(fh)
    check_chrome_trace(events)
    assert len(events) == 21 and events[-1]["name"] == "trace truncated"
    assert os.path.getsize(path) < 4000


def test_trace_overlapping_jobs_get_their_own_slot_and_lost_jobs_end(tmp_path):
    path = str(tmp_path / "t.json")
    tw = TraceWriter(path, board="b", pid=7)
    tw.on_actions([SubmitJob(0, _job(1), [11]), SubmitJob(0, _job(2), [12])], 1.0)
    tw.on_result(0, _result(1), 1.5)
    tw.on_actions([SubmitJob(0, _job(3), [13])], 1.6)  # reuses the freed slot 0
    tw.on_chip_down(0, 2.0)  # jobs 2 and 3 never answer
    tw.turn(2.0, 2.001, 1, 2, "kv")
    tw.on_actions([FinishRequest(11, "length", {"prompt_tokens": 1},
                                 {"e2e_ms": 1000.0, "queue_ms": 100.0, "ttft_ms": 300.0}),
                   FailRequest(12, 500, "worker_died", "x", True, {"e2e_ms": 1000.0, "queue_ms": 50.0,
                                                                   "ttft_ms": None})], 2.0)
    tw.close()
    with open(path) as fh:
        events = json.load(fh)
    check_chrome_trace(events)
    (turn,) = [e for e in events if e["name"] == "turn"]
    assert turn["args"] == {"events": 1, "actions": 2, "admission_blocked": "kv"} and turn["dur"] == 1000
    jobs = {e["args"]["job"]: e for e in events if e["ph"] == "X" and e["name"] != "turn"}
    assert jobs[1]["tid"] == jobs[3]["tid"] != jobs[2]["tid"]
    assert jobs[1]["dur"] == 500_000 and jobs[1]["args"]["device_ms"] == 0.1
    assert jobs[2]["args"]["status"] == jobs[3]["args"]["status"] == "lost"
    spans = defaultdict(dict)
    for e in events:
        if e["ph"] in "be":
            spans[e["id"]].setdefault(e["name"], []).append(e["ts"])
    assert spans["r11"] == {"request": [1_000_000, 2_000_000], "queued": [1_000_000, 1_100_000],
                            "prefill": [1_100_000, 1_300_000], "decode": [1_300_000, 2_000_000]}
    # a request that failed before its first token: queued, then prefill until the end, no decode
    assert spans["r12"] == {"request": [1_000_000, 2_000_000], "queued": [1_000_000, 1_050_000],
                            "prefill": [1_050_000, 2_000_000]}


@pytest.mark.integration
def test_unwritable_trace_file_fails_startup(daemon, short_dir):
    path = os.path.join(short_dir, "no-such-dir", "t.json")
    d = daemon(backend="stub", extra=["--trace", path], wait=False)
    d.expect_exit = 1
    assert d.proc.wait(60) == 1
    assert f"cannot write the trace file {path}" in d.log()


def test_trace_device_track_shows_calls_and_idle_gaps(tmp_path):
    path = str(tmp_path / "t.json")
    tw = TraceWriter(path, board="b", pid=7, t0=1.0)
    tw.on_actions([SubmitJob(0, _job(1), [11]), SubmitJob(0, _job(2), [11])], 1.0)
    r1, r2 = _result(1), _result(2)
    r1.device_start_ns, r1.idle_us = 1_000_100_000, -1
    r2.device_start_ns, r2.idle_us = 1_000_250_000, 50  # 50 us after job 1's 100 us call ended
    tw.on_result(0, r1, 1.01)
    tw.on_result(0, r2, 1.02)
    tw.close()
    with open(path) as fh:
        events = json.load(fh)
    check_chrome_trace(events)
    dev = [e for e in events if e["ph"] == "X" and e.get("tid") == 5000]
    assert [(e["name"], e["ts"], e["dur"]) for e in dev] == [
        ("device decode", 100, 100), ("idle", 200, 50), ("device decode", 250, 100)]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[5000] == "chip 0 device"
