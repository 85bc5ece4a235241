"""MetricsRecorder in-process: what each loop fact adds, and that a scrape reads only the published snapshot."""

from __future__ import annotations

import numpy as np
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.actions import EmitTokens, FailRequest, FinishRequest, SubmitJob
from engine.daemon.observability.metrics import Family, MetricsRecorder
from ipc.records import JobKind, JobResult, JobStatus, Lane, build_job


def samples(m: MetricsRecorder) -> dict:
    text = generate_latest(m.registry).decode()
    out = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def _job(job_id: int):
    lane = Lane(tokens=[1], start=0, block_table=[0])
    return build_job(JobKind.DECODE, [lane], job_id=job_id, generation=1, batch=1, table_width=1)


def test_actions_feed_the_histograms_and_counters():
    m = MetricsRecorder("m")
    timing = {"e2e_ms": 1500.0, "ttft_ms": 200.0, "queue_ms": 50.0}
    m.on_actions([EmitTokens(1, [5])], 1.0)
    m.on_actions([EmitTokens(1, [6]), EmitTokens(2, [7])], 1.02)  # request 2's first tokens: no interval
    m.on_actions([EmitTokens(1, [8, 9]), FinishRequest(1, "length", {}, timing)], 1.1)
    m.on_actions([FailRequest(2, 504, "deadline_exceeded", "x", False, timing),
                  FailRequest(3, 400, "empty_prompt", "x", False, None)], 1.2)  # 3 was never accepted
    s = samples(m)
    assert s[("npuserve:inter_token_latency_seconds_count", ())] == 2  # 1.0 -> 1.02 -> 1.1 of request 1
    assert abs(s[("npuserve:inter_token_latency_seconds_sum", ())] - 0.1) < 1e-9
    assert s[("npuserve:inter_token_latency_seconds_bucket", (("le", "0.025"),))] == 1
    assert s[("npuserve:e2e_request_latency_seconds_count", ())] == 1
    assert s[("npuserve:e2e_request_latency_seconds_bucket", (("le", "1.5"),))] == 1
    assert s[("npuserve:e2e_request_latency_seconds_bucket", (("le", "1.0"),))] == 0
    assert s[("npuserve:time_to_first_token_seconds_sum", ())] == 0.2
    assert s[("npuserve:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("npuserve:request_failure_total", (("reason", "deadline_exceeded"),))] == 1
    assert ("npuserve:request_failure_total", (("reason", "empty_prompt"),)) not in s
    assert not m._last_emit  # terminal events forget the request


def test_job_latency_per_chip_and_kind_and_lost_jobs_are_dropped():
    m = MetricsRecorder("m")
    m.on_actions([SubmitJob(1, _job(10), [1]), SubmitJob(1, _job(11), [2])], 2.0)
    res = JobResult(job_id=10, generation=1, kind=JobKind.DECODE, status=JobStatus.OK,
                    tokens=np.zeros(1, np.int32), logprobs=np.zeros(1, np.float32))
    m.on_result(1, res, 2.004)
    m.on_result(0, res, 2.005)  # a result for an unknown job (already counted): ignored
    m.on_chip_down(1)  # job 11 is lost with the chip
    s = samples(m)
    key = ("npuserve:job_latency_seconds_count", (("chip", "1"), ("kind", "decode")))
    assert s[key] == 1 and abs(s[("npuserve:job_latency_seconds_sum", key[1])] - 0.004) < 1e-9
    assert not m._job_start


def test_a_scrape_reads_the_published_snapshot_only():
    m = MetricsRecorder("m")
    assert not any(k[0] == "npuserve:queue_depth" for k in samples(m))  # nothing published yet
    m.collector.snapshot = (Family("gauge", "queue_depth", "d", ("model_name", "chip", "queue"),
                                   ((("m", "0", "decode"), 3.0),)),)
    assert samples(m)[("npuserve:queue_depth", (("chip", "0"), ("queue", "decode")))] == 3.0


def test_idle_gaps_and_busy_fraction_per_chip():
    m = MetricsRecorder("m")
    m.occupancy.window(10.0)  # the window starts
    m.on_actions([SubmitJob(0, _job(1), [1]), SubmitJob(0, _job(2), [2])], 10.0)
    for job_id, idle in ((1, -1), (2, 150)):  # the first call after start has no gap
        m.on_result(0, JobResult(job_id=job_id, generation=1, kind=JobKind.DECODE, status=JobStatus.OK,
                                 tokens=np.zeros(1, np.int32), logprobs=np.zeros(1, np.float32),
                                 device_us=200_000, device_start_ns=1, idle_us=idle), 10.4)
    s = samples(m)
    assert s[("npuserve:chip_idle_gap_seconds_count", (("chip", "0"),))] == 1
    assert abs(s[("npuserve:chip_idle_gap_seconds_sum", (("chip", "0"),))] - 150e-6) < 1e-12
    busy = m.occupancy.window(10.5)
    assert abs(busy[("m", 0)] - 0.8) < 1e-9  # 0.4 s of device time in a 0.5 s window
    assert m.occupancy.window(11.0) == {("m", 0): 0.0}  # nothing ran since
