"""`npuserve soak --duration 10m`: steady mixed load, every request checked, resources watched.

Starts its own daemon (`--backend`, `--chips`) or drives `--endpoint`. Keeps
`--concurrency` requests outstanding (see `tools.soak.mix` for the mix), checks
each finished request (exactly one terminal event, nothing after it, the
right outcome for its kind, the same tokens as the request run alone), prints
a line per interval (requests, errors by code, TTFT/TPOT percentiles, RSS,
FDs, /dev/shm) and ends with a verdict: exit 1 on any violation or leak.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time

from tools.load.local_daemon import alive_pid
from tools.load.report import pct
from tools.soak.resources import LeakThresholds, Sampler, leak_verdict

MAX_VIOLATIONS_KEPT = 50


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"duration {text!r}: expected e.g. 30s, 10m, 24h")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npuserve soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=parse_duration, default=parse_duration("10m"), help="e.g. 30s, 10m, 24h")
    p.add_argument("--endpoint", help="soak this daemon or balancer instead of starting a daemon")
    p.add_argument("--backend", choices=("stub", "sim", "ref"), default="ref")
    p.add_argument("--chips", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="daemon config override")
    p.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--concurrency", type=int, default=16, help="requests outstanding at once")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--interval", type=parse_duration, help="seconds between progress lines (default: duration/20, 5..60)")
    p.add_argument("--no-oracle", action="store_true", help="skip the comparison with the request run alone")
    p.add_argument("--warmup", type=float, default=0.25, help="fraction of the run before the leak fit starts")
    p.add_argument("--leak-bytes-per-request", type=float, default=512.0,
                   help="memory slope above which (with >= 1 MiB fitted growth) a leak is reported")
    p.add_argument("--request-timeout", type=float, default=120.0, help="a request with no terminal event by then "
                                                                        "is a violation")
    p.add_argument("--json", action="store_true", help="JSON Lines: a sample per interval, then the verdict")
    return p


class Soak:
    def __init__(self, a: argparse.Namespace, endpoint: str, model: dict, daemon_pid: int | None) -> None:
        from tools.soak.mix import Expected, templates

        self.a = a
        self.endpoint = endpoint
        self.model = model
        self.pool = templates(model)
        self.expected = Expected(model, not a.no_oracle and (a.endpoint is None or model.get("backend") != "ref"))
        self.rng = random.Random(a.seed)
        self.sampler = Sampler(daemon_pid, every_s=max(0.5, min(5.0, a.duration / 200)))
        self.daemon_pid = daemon_pid
        self.finished = 0
        self.by_kind: dict[str, int] = {}
        self.errors_by_code: dict[str, int] = {}
        self.finish_reasons: dict[str, int] = {}
        self.violations: list[dict] = []
        self.violation_count = 0
        self.window_ttft: list[float] = []
        self.window_tpot: list[float] = []
        self.window_start = time.monotonic()
        self.window_finished = 0
        self.timeline: list[dict] = []
        self.t0 = time.monotonic()
        self.checked_oracle = 0

    def violate(self, what: str, **ctx) -> None:
        self.violation_count += 1
        if len(self.violations) < MAX_VIOLATIONS_KEPT:
            self.violations.append({"t_s": round(time.monotonic() - self.t0, 2), "what": what, **ctx})

    def account(self, tr, tmpl) -> None:
        from tools.soak.mix import check

        self.finished += 1
        self.window_finished += 1
        self.by_kind[tr.kind] = self.by_kind.get(tr.kind, 0) + 1
        term = tr.terminal
        if term is not None and term["ev"] == "error":
            c = str(term.get("code"))
            self.errors_by_code[c] = self.errors_by_code.get(c, 0) + 1
        elif term is not None:
            r = str(term.get("finish_reason"))
            self.finish_reasons[r] = self.finish_reasons.get(r, 0) + 1
        want = self.expected.tokens(tmpl)
        self.checked_oracle += want is not None
        for v in check(tr, tmpl, want):
            self.violate(v, request=tr.rid, kind=tr.kind, template=tmpl.key)
        if tr.ttft_ms is not None and tr.kind in ("normal", "prefix", "long"):
            self.window_ttft.append(tr.ttft_ms)
        if tr.tpot_ms is not None and tr.kind in ("normal", "prefix", "long"):
            self.window_tpot.append(tr.tpot_ms)

    def sample_line(self, final: bool = False) -> dict:
        now = time.monotonic()
        dt = max(now - self.window_start, 1e-9)
        s = self.sampler.samples[-1].values if self.sampler.samples else {}
        row = {"t_s": round(now - self.t0, 1), "requests": self.finished,
               "requests_per_s": round(self.window_finished / dt, 2), "errors_by_code": dict(self.errors_by_code),
               "ttft_p50_ms": pct(self.window_ttft, 0.5), "ttft_p99_ms": pct(self.window_ttft, 0.99),
               "tpot_p50_ms": pct(self.window_tpot, 0.5), "tpot_p99_ms": pct(self.window_tpot, 0.99),
               "daemon_anon_rss_mb": round(s.get("daemon_anon_rss", 0) / 2**20, 1),
               "workers_anon_rss_mb": round(s.get("workers_anon_rss", 0) / 2**20, 1),
               "fds": s.get("daemon_fds", 0) + s.get("workers_fds", 0), "shm_objects": s.get("shm_objects", 0),
               "shm_mb": round(s.get("shm_bytes", 0) / 2**20, 1), "violations": self.violation_count}
        self.window_ttft, self.window_tpot = [], []
        self.window_start, self.window_finished = now, 0
        self.timeline.append(row)
        return row

    def print_sample(self, row: dict) -> None:
        if self.a.json:
            from tools.json_lines import emit

            emit("sample", row)
        errs = ", ".join(f"{k}: {v}" for k, v in sorted(row["errors_by_code"].items())) or "none"
        print(f"soak {row['t_s']:>7.0f}s  {row['requests']:>7} req ({row['requests_per_s']:.1f}/s)  errors {errs}  "
              f"TTFT p50/p99 {row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms  TPOT p50/p99 {row['tpot_p50_ms']}/"
              f"{row['tpot_p99_ms']} ms  anon RSS {row['daemon_anon_rss_mb']}+{row['workers_anon_rss_mb']} MB  fds {row['fds']}  "
              f"shm {row['shm_objects']} ({row['shm_mb']} MB)  violations {row['violations']}",
              file=sys.stderr, flush=True)

    async def run(self) -> None:
        from tools.load.wire_load import WireLoad
        from tools.soak.mix import pick

        a = self.a
        load = WireLoad(self.endpoint)
        end = self.t0 + a.duration
        interval = a.interval or max(5.0, min(60.0, a.duration / 20))
        pending: list[tuple[float, object, object]] = []  # (check at, trace, template): checked after a grace

        async def slot() -> None:
            while time.monotonic() < end:
                tmpl, kind, extra = pick(self.rng, self.pool)
                cancel_after = extra.pop("cancel_after", None)
                tr = await load.start(list(tmpl.prompt), kind=kind, cancel_after=cancel_after,
                                      **tmpl.fields(), **extra)
                if not await load.finished(tr, a.request_timeout):
                    self.violate(f"no terminal event within {a.request_timeout:.0f} s", request=tr.rid, kind=kind)
                pending.append((time.monotonic() + 1.0, tr, tmpl))

        async def watch() -> None:
            next_print = time.monotonic() + interval
            while True:
                await asyncio.sleep(0.25)
                now = time.monotonic()
                while pending and pending[0][0] <= now:
                    _, tr, tmpl = pending.pop(0)
                    self.account(tr, tmpl)
                    load.forget(tr)
                for ev in load.unknown_events:
                    self.violate("event for an unknown or long-finished request id", event=str(ev)[:200])
                load.unknown_events.clear()
                self.sampler.maybe_sample(self.finished)
                err = load.receiver_error()
                if err is not None:
                    self.violate(f"the soak's own client stopped receiving: {err!r}")
                    return
                if self.daemon_pid is not None and not alive_pid(self.daemon_pid):
                    self.violate("the daemon process died")
                    return
                if now >= next_print:
                    next_print = now + interval
                    self.print_sample(self.sample_line())

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            slots = [asyncio.get_running_loop().create_task(slot()) for _ in range(a.concurrency)]
            done, _ = await asyncio.wait([*slots, watcher], return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:  # the daemon died: stop the load
                for s in slots:
                    s.cancel()
            await asyncio.gather(*slots, return_exceptions=True)
            await asyncio.sleep(1.2)  # the last grace period: anything sent after a terminal event shows now
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            for _, tr, tmpl in pending:
                self.account(tr, tmpl)
            for ev in load.unknown_events:
                self.violate("event for an unknown or long-finished request id", event=str(ev)[:200])
            self.sampler.maybe_sample(self.finished)
            self.print_sample(self.sample_line(final=True))
        finally:
            await load.close()

    def verdict(self, teardown: list[str]) -> dict:
        for t in teardown:
            self.violate(t)
        th = LeakThresholds(rss_bytes_per_request=self.a.leak_bytes_per_request, warmup_fraction=self.a.warmup)
        leaks = leak_verdict(self.sampler.samples, th) if self.daemon_pid is not None else {"enough_samples": False}
        fail = bool(self.violation_count) or bool(leaks.get("leak"))
        return {"verdict": "fail" if fail else "pass", "requests": self.finished,
                "violations": self.violations, "violation_count": self.violation_count,
                "leaks": leaks, "errors_by_code": dict(self.errors_by_code),
                "finish_reasons": dict(self.finish_reasons), "by_kind": dict(self.by_kind),
                "checked_against_oracle": self.checked_oracle, "duration_s": round(time.monotonic() - self.t0, 1),
                "backend": self.model.get("backend"), "concurrency": self.a.concurrency,
                "timeline": self.timeline}


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    if a.concurrency < 1 or a.chips < 1 or a.duration <= 0:
        print("npuserve soak: --concurrency, --chips and --duration must be positive", file=sys.stderr)
        return 2
    from tools.load import local_daemon

    d = None
    try:
        if a.endpoint:
            endpoint = a.endpoint
        else:
            d = local_daemon.start(backend=a.backend, chips=a.chips, settings=a.set,
                                   backend_options=a.backend_option, prefix="nps-")
            endpoint = d.endpoint
        health = local_daemon.wait_healthy(endpoint, d, chips_up=1 if a.endpoint else a.chips)
        pid = d.pid if d else health.get("pid")
        if pid is not None and not os.path.exists(f"/proc/{pid}"):
            pid = None  # a remote endpoint: no resource trend
        print(f"npuserve soak: {a.duration:.0f} s against {endpoint} ({health['model'].get('backend')} backend, "
              f"{len(health.get('chips', []))} chips), {a.concurrency} requests outstanding", file=sys.stderr)
        soak = Soak(a, endpoint, health["model"], pid)
        asyncio.run(soak.run())
        workers = []
        if d is not None:
            try:
                workers = [c["pid"] for c in local_daemon.wait_healthy(endpoint, d, timeout=10)["chips"] if c.get("pid")]
            except SystemExit:
                pass
        res = soak.verdict(d.stop_and_check(workers) if d is not None else [])
    finally:
        if d is not None:
            if d.exit_code not in (None, 0):
                sys.stderr.write(f"daemon log tail:\n{d.log_tail()}\n")
            d.cleanup()
    if a.json:
        from tools.json_lines import emit

        emit("verdict", res)
    leaks = res["leaks"]
    flagged = [k for k, v in leaks.items() if isinstance(v, dict) and v.get("leak")]
    print(f"soak: {res['verdict'].upper()}: {res['requests']} requests in {res['duration_s']} s, "
          f"{res['violation_count']} violations, errors {res['errors_by_code'] or 'none'}, "
          f"finish reasons {res['finish_reasons']}, {res['checked_against_oracle']} compared with the request run alone; "
          + ("leak fit: not enough samples" if not leaks.get("enough_samples") else
             f"leaks {flagged or 'none'} (daemon anon RSS {leaks['daemon_anon_rss']['per_request']:.0f} B/request, "
             f"workers {leaks['workers_anon_rss']['per_request']:.0f} B/request after {leaks['warmup_s']} s warm-up)"),
          file=sys.stderr if a.json else sys.stdout)
    for v in res["violations"][:10]:
        print(f"  violation at {v['t_s']} s: {v['what']}", file=sys.stderr)
    return 0 if res["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
