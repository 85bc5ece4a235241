"""Prometheus /metrics of a real daemon, scraped over HTTP and parsed with prometheus_client's parser."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from repo_root import ROOT
from engine.errors import InvalidRequest
from tools.load.ports import free_port

pytestmark = pytest.mark.integration

# vLLM-mirrored families (family names as the parser reports them: counters without _total)
VLLM_NAMED = ["npuserve:num_requests_running", "npuserve:num_requests_waiting", "npuserve:kv_cache_usage_perc",
              "npuserve:prefix_cache_queries", "npuserve:prefix_cache_hits", "npuserve:time_to_first_token_seconds",
              "npuserve:inter_token_latency_seconds", "npuserve:e2e_request_latency_seconds",
              "npuserve:prompt_tokens", "npuserve:generation_tokens", "npuserve:request_success"]
# the scheduler's own figures (docs/observability.md)
SEED_NAMED = ["npuserve:queue_depth", "npuserve:queue_oldest_wait_seconds", "npuserve:requests_admitted",
              "npuserve:requests_rejected", "npuserve:batch_fill_ratio", "npuserve:decode_lane_waste",
              "npuserve:kv_blocks", "npuserve:worker_restarts", "npuserve:job_latency_seconds"]
ID_LABELS = {"id", "rid", "request", "request_id", "job", "job_id", "seq", "seq_id"}
SIM = {"decode_base_ms": 2.0, "decode_per_lane_ms": 0.0}


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, sample: str, **labels: str) -> float:
    family = sample
    for suffix in ("_total", "_count", "_sum", "_bucket"):
        family = family.removesuffix(suffix)
    fam = fams[family]
    return sum(s.value for s in fam.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def series(fams: dict) -> set:
    return {(s.name, tuple(sorted(s.labels.items()))) for f in fams.values() for s in f.samples}


def wait_for(pred, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_metrics_scraped_during_load(daemon):
    port = free_port()
    d = daemon(backend="sim", chips=2, settings={"metrics.port": port, "metrics.host": "127.0.0.1"},
               backend_options=SIM)
    first = scrape(port)
    for name in VLLM_NAMED + SEED_NAMED:
        assert name in first, f"{name} missing from /metrics"
    # docs/observability.md lists exactly what is exposed
    with open(os.path.join(ROOT, "docs", "observability.md")) as fh:
        documented = set(re.findall(r"^\| `(npuserve:[a-z0-9_]+)` \|", fh.read(), re.M))
    exposed = {n + ("_total" if f.type == "counter" else "") for n, f in first.items()}
    assert documented == exposed
    assert first["npuserve:e2e_request_latency_seconds"].type == "histogram"
    assert first["npuserve:request_success"].type == "counter"
    assert first["npuserve:num_requests_running"].type == "gauge"

    results: list = []
    ids: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def load(k: int) -> None:
        with d.client(timeout=60) as c:
            i = 0
            while not stop.is_set():
                rid = f"load-{k}-{i}"
                prompt = [1 + (k * 7 + i) % 200, 2, 3, 4, 5][: 2 + i % 4]
                r = c.generate(prompt, max_tokens=30 + 5 * (i % 3), seed=i, id=rid)
                with lock:
                    results.append((prompt, r))
                    ids.append(rid)
                i += 1

    threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        # during load: the token counter moves between scrapes, and requests are seen running
        base = value(first, "npuserve:generation_tokens_total")
        seen_running = []

        def moved():
            f = scrape(port)
            seen_running.append(value(f, "npuserve:num_requests_running"))
            return value(f, "npuserve:generation_tokens_total") > base and f

        mid = wait_for(moved, what="generation_tokens_total to move during load")
        mid_tokens = value(mid, "npuserve:generation_tokens_total")
        wait_for(lambda: value(scrape(port), "npuserve:generation_tokens_total") > mid_tokens,
                 what="generation_tokens_total to move again")
        wait_for(lambda: any(v > 0 for v in seen_running) or seen_running.append(
            value(scrape(port), "npuserve:num_requests_running")), what="a running request in a scrape")
        with d.client(timeout=10) as c:
            with pytest.raises(InvalidRequest):
                c.generate([1, 100000], max_tokens=2)
            r = c.generate([1, 2], max_tokens=2, tenant="unconfigured-tenant-7")
            with lock:
                results.append(([1, 2], r))
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert len(results) >= 8

    finished = len(results)
    completion = sum(r.usage["completion_tokens"] for _, r in results)
    prompt_tokens = sum(len(p) for p, _ in results)
    # the snapshot-fed counters catch up within a publish interval
    # (the start-up load's warm-up requests, one per chip, are the board's own tokens: counted before `first`)
    gen0, prompt0 = value(first, "npuserve:generation_tokens_total"), value(first, "npuserve:prompt_tokens_total")
    assert gen0 > 0
    end = wait_for(lambda: (lambda f: value(f, "npuserve:generation_tokens_total") - gen0 == completion and f)(
        scrape(port)), what="generation_tokens_total to equal the tokens the clients received")
    assert value(end, "npuserve:prompt_tokens_total") - prompt0 == prompt_tokens
    # histograms count every finished request
    for h in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds"):
        assert value(end, f"npuserve:{h}_count") == finished, h
        assert value(end, f"npuserve:{h}_bucket", le="+Inf") == finished, h
    assert value(end, "npuserve:request_success_total") == finished
    assert value(end, "npuserve:request_success_total", finished_reason="length") == finished
    # one inter-token interval per token after the first (each decode step emits one token per request)
    assert value(end, "npuserve:inter_token_latency_seconds_count") == completion - finished
    assert value(end, "npuserve:requests_rejected_total", reason="token_out_of_range") == 1
    stats = d.client(timeout=10).stats()
    assert value(end, "npuserve:job_latency_seconds_count") == stats["daemon"]["results"]
    # every result after a chip's first reports the idle gap before it; busy fractions are fractions
    assert 0 < value(end, "npuserve:chip_idle_gap_seconds_count") < stats["daemon"]["results"]
    assert all(0.0 <= value(end, "npuserve:chip_busy_fraction", chip=c) <= 1.0 for c in ("0", "1"))
    assert value(end, "npuserve:decode_jobs_total") == stats["scheduler"]["counters"]["decode_jobs"]
    assert value(end, "npuserve:num_requests_running") == 0
    # blocks by state partition each chip's pool
    for chip in ("0", "1"):
        total = stats["scheduler"]["chips"][chip]["kv"]["blocks"]["total"]
        assert value(end, "npuserve:kv_blocks", chip=chip) == total

    # no series carries a request id, and the set of series does not grow with the number of requests
    for f in end.values():
        for s in f.samples:
            assert not ID_LABELS & set(s.labels), s
            assert not set(s.labels.values()) & set(ids), s
    # a tenant the configuration does not name is summed as "other": tenants cannot grow the series
    tenants = {s.labels["tenant"] for s in end["npuserve:tenant_service_tokens"].samples}
    assert tenants == {"default", "other"}
    before = series(end)
    with d.client(timeout=30) as c:
        for i in range(5):
            c.generate([9, 8, 7], max_tokens=3, seed=100 + i, id=f"more-{i}")
    after = wait_for(lambda: (lambda f: value(f, "npuserve:e2e_request_latency_seconds_count") == finished + 5
                              and f)(scrape(port)), what="five more requests counted")
    assert series(after) == before


def test_busy_metrics_port_fails_startup_with_a_clear_message(daemon):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        d = daemon(backend="stub", settings={"metrics.port": port}, wait=False)
        d.expect_exit = 1
        rc = d.proc.wait(60)
    log = d.log()
    assert rc == 1, log
    assert f"metrics port 127.0.0.1:{port} is in use" in log and "--metrics-port" in log
    assert "\"event\":\"serving\"" not in log and "chip_up" not in log  # failed before serving
