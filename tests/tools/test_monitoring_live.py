"""A real Prometheus against a live ref board, a balancer and two HTTP fronts, with the files
`npuserve install-monitoring` writes (scrape and evaluation every second, `for: 1s`, 6 s rate windows).

One module-scoped set-up for every test (processes start once); the tests run in file order because the
later ones inject faults: names first, then an idle board, then load, a KV flood, a killed worker and last a
stopped board. Every wait is for a state Prometheus reports (its HTTP API), with a generous hang guard.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import psutil
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from daemon_procs import START_TIMEOUT_S, daemon_process
from http_front_procs import http_front_process
from repo_root import ROOT
from tools.load.ports import free_port
from waiting import read_log
from tools.monitoring import dashboard, dashboard_png, install_cmd

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin")  # Debian's place
RATE_S = 6
RATE_WINDOW = f"{RATE_S}s"  # the rules' rate window here: six scrapes
HANG_GUARD_S = 180.0  # a hang guard only: every wait ends as soon as Prometheus reports the state
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
# Documented series: the tables of observability.md (boards), http.md (fronts) and balancer.md (balancers).
DOC_TABLES = ("observability.md", "http.md", "balancer.md")
BOARD_SETTINGS = {
    "kv.num_blocks": 24,  # a small KV pool, so a flood fills it with requests waiting
    "kv.host_pool_mb": 1,  # a host tier: the dashboard's "KV usage by tier" has a tier to show
    "speculative.method": "ngram",  # drafts: the acceptance figures have data
    "recovery.heartbeat_timeout_ms": 30000,  # a busy 2-core machine must not look like a hung chip
}


def documented_names() -> set[str]:
    names: set[str] = set()
    for doc in DOC_TABLES:
        with open(os.path.join(ROOT, "docs", doc)) as fh:
            names |= set(re.findall(r"^\| `(npuserve:[a-z0-9_]+)` \|", fh.read(), re.M))
    return names


def get(url: str, accept: str | None = None, timeout: float = 10.0) -> str:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def wait_for(pred, what: str, timeout: float = HANG_GUARD_S, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            got = pred()
        except (OSError, urllib.error.URLError, ValueError) as e:
            got, last = None, e
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out ({timeout:.0f} s hang guard) waiting for {what}; last error: {last!r}")
        time.sleep(interval)


class Prometheus:
    def __init__(self, config_dir: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = config_dir
        self.log_path = os.path.join(config_dir, "prometheus.log")
        self.started = time.time()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={os.path.join(config_dir, 'prometheus.yml')}",
                 f"--storage.tsdb.path={os.path.join(config_dir, 'data')}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                cwd=config_dir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def api(self, path: str, **params) -> dict:
        q = urllib.parse.urlencode(params)
        body = json.loads(get(f"{self.url}/api/v1/{path}" + (f"?{q}" if q else "")))
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def now(self) -> float:
        """Prometheus's own clock (the query API's time())."""
        return float(self.api("query", query="time()")["result"][0])

    def last_alert_evaluation(self) -> float:
        g = next(g for g in self.api("rules")["groups"] if g["name"] == "npuserve.alerts")
        m = re.match(r"(\d+-\d+-\d+T\d+:\d+:\d+)(\.\d+)?Z", g["lastEvaluation"])
        from datetime import datetime, timezone

        whole = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
        return whole + float(m.group(2) or 0)

    def alerts(self, state: str | None = None) -> list[dict]:
        return [a for a in self.api("alerts")["alerts"] if state is None or a["state"] == state]

    def firing(self, name: str, **labels: str) -> list[dict]:
        return [a for a in self.alerts("firing") if a["labels"]["alertname"] == name
                and all(a["labels"].get(k) == v for k, v in labels.items())]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return read_log(self.log_path)


class Stack:
    def __init__(self, board, board_metrics: int, balancer_endpoint: str, balancer_metrics: int, fronts) -> None:
        self.board = board
        self.board_metrics = board_metrics
        self.balancer_endpoint = balancer_endpoint
        self.balancer_metrics = balancer_metrics
        self.fronts = fronts  # [front -> balancer, front -> board]

    def metrics_urls(self) -> dict[str, str]:
        return {"board": f"http://127.0.0.1:{self.board_metrics}/metrics",
                "balancer": f"http://127.0.0.1:{self.balancer_metrics}/metrics",
                "front->balancer": self.fronts[0].url + "/metrics",
                "front->board": self.fronts[1].url + "/metrics"}


@contextlib.contextmanager
def balancer_process(backend: str, metrics_port: int):
    d = tempfile.mkdtemp(prefix="npb-", dir="/tmp")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log_path = os.path.join(d, "balancer.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "engine.balancer.main", "--endpoint", endpoint,
                                 "--backends", backend, "--metrics-port", str(metrics_port)], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def routable():
            if proc.poll() is not None:
                raise AssertionError(f"balancer exited {proc.returncode}:\n{read_log(log_path)[-3000:]}")
            from engine.client import Client

            with Client(endpoint, timeout=1.0) as c:
                return c.health().get("backends_up", 0) >= 1
        wait_for(lambda: routable(), "the balancer to route to the board", timeout=START_TIMEOUT_S)
        yield endpoint
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        text = read_log(log_path)
        shutil.rmtree(d, ignore_errors=True)
    assert rc == 0, f"balancer exited {rc}:\n{text[-3000:]}"


@pytest.fixture(scope="module")
def stack():
    board_metrics, balancer_metrics = free_port(), free_port()
    with daemon_process("ref", 2, settings={**BOARD_SETTINGS, "metrics.port": board_metrics,
                                            "metrics.host": "127.0.0.1"}) as board:
        with balancer_process(board.endpoint, balancer_metrics) as bal:
            with http_front_process(bal) as f0, http_front_process(board.endpoint) as f1:
                yield Stack(board, board_metrics, bal, balancer_metrics, [f0, f1])


@pytest.fixture(scope="module")
def prom(stack):
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus; .ci/run installs it)")
    d = tempfile.mkdtemp(prefix="npprom-", dir="/tmp")
    rc = install_cmd.main([
        "--out", d, "--host", "testhost", "--boards", f"0=127.0.0.1:{stack.board_metrics}",
        "--balancer", f"127.0.0.1:{stack.balancer_metrics}",
        "--http", ",".join(f.url.removeprefix("http://") for f in stack.fronts),
        "--scrape-interval", "1s", "--evaluation-interval", "1s", "--rate-window", RATE_WINDOW, "--for", "1s"])
    assert rc == 0
    p = Prometheus(d)
    try:
        wait_for(lambda: p.proc.poll() is None and get(p.url + "/-/ready", timeout=2) is not None,
                 "Prometheus to be ready", timeout=START_TIMEOUT_S)
        # every target scraped and up, and the rules evaluated over those scrapes
        wait_for(lambda: len(p.query('up{job=~"npuserve-.*"} == 1')) == 4, "all four targets up")
        wait_for(lambda: p.query("board:npuserve_chips_up:sum == 2"), "the recording rules to see two chips up")
        yield p
    finally:
        p.stop()
        log = p.log()
        shutil.rmtree(d, ignore_errors=True)
    assert p.proc.returncode is not None, log


class Load:
    """Requests in the background until stopped: the client library through the balancer, and OpenAI
    streams through both fronts (the fronts' own TTFT). Errors while a fault is injected are expected."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.stop_ev = threading.Event()
        self.threads: list[threading.Thread] = []
        self.done = 0

    def start(self, clients: int = 2, max_tokens: int = 24) -> None:
        for k in range(clients):
            self._spawn(self._client_loop, k, max_tokens)
        for front in self.stack.fronts:
            self._spawn(self._http_loop, front.url)

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def _client_loop(self, k: int, max_tokens: int) -> None:
        from engine.client import Client
        from engine.errors import ClientError

        i = 0
        with Client(self.stack.balancer_endpoint, timeout=60) as c:
            while not self.stop_ev.is_set():
                try:
                    c.generate([1 + (k * 13 + i) % 200, 5, 6, 7, 5, 6, 7, 5, 6], max_tokens=max_tokens, seed=i)
                    self.done += 1
                except ClientError:
                    time.sleep(0.05)
                i += 1

    def _http_loop(self, url: str) -> None:
        import httpx

        body = {"model": "tiny", "prompt": "one two one two one two", "max_tokens": 12, "stream": True}
        with httpx.Client(timeout=60) as h:
            while not self.stop_ev.is_set():
                try:
                    with h.stream("POST", url + "/v1/completions", json=body) as r:
                        for _ in r.iter_bytes():
                            pass
                except httpx.HTTPError:
                    time.sleep(0.05)

    def stop(self) -> None:
        self.stop_ev.set()
        for t in self.threads:
            t.join(90)
        self.threads.clear()
        self.stop_ev.clear()


@pytest.fixture(scope="module")
def load(stack, prom):
    ld = Load(stack)
    ld.start()
    wait_for(lambda: ld.done >= 3, "the load to complete requests")
    yield ld
    ld.stop()


# -- issue: one name per series, whatever the scraper negotiates ------------------------------------------
def _sample_names(families) -> set[str]:
    return {s.name for f in families for s in f.samples}


def test_openmetrics_and_text_name_every_sample_alike(stack):
    for who, url in stack.metrics_urls().items():
        text = get(url)
        om = get(url, accept=OPENMETRICS)
        text_names = _sample_names(parse_text(text))
        om_names = _sample_names(parse_openmetrics(om))
        assert text_names, f"{who}: no samples"
        assert om_names == text_names, (f"{who}: only in OpenMetrics {sorted(om_names - text_names)[:5]}, "
                                        f"only in text {sorted(text_names - om_names)[:5]}")
        assert all(n.startswith("npuserve:") for n in om_names), f"{who}: {sorted(om_names)[:5]}"
    # the front in front of the board re-exports the board's series under the same names
    assert "npuserve:chip_up" in _sample_names(parse_openmetrics(get(stack.fronts[1].url + "/metrics",
                                                                     accept=OPENMETRICS)))


def test_idle_healthy_board_fires_nothing(stack, prom):
    # judged after the alert rules have run over a whole rate window (and `for:`) of scrapes of the idle stack
    start = prom.now()
    wait_for(lambda: prom.last_alert_evaluation() > start + RATE_S + 2, "a rate window and more of alert evaluations")
    assert prom.alerts() == [], prom.alerts()


def missing_from(stored: set[str], documented: set[str]) -> set[str]:
    """The documented names a Prometheus query does not find (counters are documented with their _total and
    histograms by their family name, stored as _bucket/_sum/_count)."""
    return {n for n in documented if n not in stored and f"{n}_count" not in stored}


def test_prometheus_stores_every_documented_metric_by_its_documented_name(stack, prom, load):
    from engine.client import Client
    from engine.errors import ClientError

    # events behind the counters that only exist once something happened: a rejection and a failure
    with Client(stack.board.endpoint, timeout=30) as c:
        with pytest.raises(ClientError) as e:
            c.generate([10**6], max_tokens=2)  # requests_rejected_total
        assert e.value.reason == "token_out_of_range", e.value
        with pytest.raises(ClientError) as e:
            c.generate([5, 6, 7], max_tokens=100, deadline_ms=1)  # accepted, then failed: request_failure_total
        assert e.value.reason == "deadline_exceeded", e.value
    documented = documented_names()
    assert len(documented) > 60 and "npuserve:balancer_backend_up" in documented

    def stored():
        return set(prom.api("label/__name__/values"))
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        names = stored()
        missing = missing_from(names, documented)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, f"documented but not stored by Prometheus: {sorted(missing)}"
    assert not [n for n in names if n.startswith("npuserve_")], "a name stored with the colon rewritten"
    # and one query by each documented name returns series (the API answers by that name)
    for n in sorted(documented):
        q = n if n in names else f"{n}_count"
        assert prom.query(f"count({q})"), n
    # the check itself finds a documented name that is not there
    assert missing_from(names, documented | {"npuserve:not_exported_total"}) == {"npuserve:not_exported_total"}


def test_every_dashboard_query_returns_series(stack, prom, load):
    import httpx

    qs = dashboard.queries(rate_interval=RATE_WINDOW)
    assert len(qs) >= 25
    for front in stack.fronts:  # the "HTTP errors" query needs an error: a body without a prompt is a 400
        assert httpx.post(front.url + "/v1/completions", json={"model": "tiny"}, timeout=30).status_code == 400

    def empty():
        return [(t, e) for t, e in qs if not prom.query(e)]
    deadline = time.monotonic() + HANG_GUARD_S
    while (left := empty()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"panels with a query that returns nothing: {left}"


def test_kv_flood_with_requests_waiting_fires_the_kv_alert(stack, prom, load):
    flood = Load(stack)
    flood.start(clients=10, max_tokens=200)
    try:
        a = wait_for(lambda: prom.firing("NpuserveKVCacheFull"), "NpuserveKVCacheFull to fire")
    finally:
        flood.stop()
    assert a[0]["labels"]["severity"] == "warning" and a[0]["labels"]["board"] == "0"
    assert a[0]["annotations"]["runbook_url"] == "docs/troubleshooting.md#npuservekvcachefull"


def test_killed_worker_fires_the_chip_alert_until_the_chip_is_back(stack, prom, load):
    chip = stack.board.health()["chips"][0]
    os.kill(chip["pid"], signal.SIGKILL)
    a = wait_for(lambda: prom.firing("NpuserveChipDown", chip=str(chip["chip"])), "NpuserveChipDown to fire")
    assert a[0]["labels"]["severity"] == "warning"
    wait_for(lambda: stack.board.health()["chips_up"] == 2, "the chip back in service")
    wait_for(lambda: not [x for x in prom.alerts() if x["labels"]["alertname"] == "NpuserveChipDown"],
             "NpuserveChipDown to resolve")


def test_the_dashboard_picture_draws_every_panel_from_the_run(prom, tmp_path):
    # the whole run so far: idle, load, the KV flood, the killed worker
    end = prom.now()
    out = tmp_path / "dashboard.png"
    drawn = dashboard_png.render(prom.url, str(out), prom.started, end, step=1.0, rate_interval=RATE_WINDOW)
    assert out.stat().st_size > 10_000 and all(n > 0 for n in drawn.values()), drawn
    if os.environ.get("NPUSERVE_DASHBOARD_PNG"):  # how docs/img/monitoring-dashboard.png was made
        shutil.copy(out, os.environ["NPUSERVE_DASHBOARD_PNG"])


def test_stopped_board_fires_board_down(stack, prom, load):
    procs = [psutil.Process(stack.board.pid)] + psutil.Process(stack.board.pid).children(recursive=True)
    for p in procs:
        p.send_signal(signal.SIGSTOP)
    try:
        a = wait_for(lambda: prom.firing("NpuserveBoardDown"), "NpuserveBoardDown to fire")
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
    assert a[0]["labels"]["severity"] == "critical" and a[0]["labels"]["board"] == "0"
    wait_for(lambda: not prom.firing("NpuserveBoardDown"), "NpuserveBoardDown to resolve once it runs again")
