"""`npuserve soak --duration 10m`: steady mixed load, every request checked, resources watched.

Starts its own daemon (`--backend`, `--chips`) or drives `--endpoint`. Keeps
`--concurrency` requests outstanding (see `tools.soak.mix` for the mix), checks
each finished request (exactly one terminal event, nothing after it, the
right outcome for its kind, the same tokens as the request run alone), prints
a line per interval (requests, errors by code, TTFT/TPOT percentiles, RSS,
FDs, /dev/shm) and ends with a verdict: exit 1 on any violation or leak.

With `--switch-every` the board serves two packages under one alias and the
soak switches between them (`replace`, `rollback`, in turn) while the load
runs; with `--fault-every` it injects the chaos tool's faults in turn
(`tools.soak.switches`, `tools.soak.faults`, `tools.soak.rounds`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

from tools.load.local_daemon import alive_pid
from tools.load.report import pct
from tools.soak.faults import FAULTS, WORKER_FAULTS
from tools.soak.periods import parse_duration, parse_every
from tools.soak.resources import LeakThresholds, Sample, Sampler, leak_verdict

MAX_VIOLATIONS_KEPT = 50


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npuserve soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=parse_duration, default=parse_duration("10m"), help="e.g. 30s, 10m, 24h")
    p.add_argument("--endpoint", help="soak this daemon or balancer instead of starting a daemon")
    p.add_argument("--backend", choices=("stub", "sim", "ref", "llamacpp"), default="ref")
    p.add_argument("--package", metavar="DIR", help="the model package the daemon serves (default: the backend's "
                                                    "built-in tiny model); not with --switch-every")
    p.add_argument("--chips", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="daemon config override")
    p.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--concurrency", type=int, default=16, help="requests outstanding at once")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prompt-ids", type=int, default=256, metavar="N",
                   help="prompt token ids are drawn below N (and the model's vocabulary; default 256)")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N", help="output tokens per request: 1..N")
    p.add_argument("--fresh-prompts", action="store_true",
                   help="every request a new prompt and seed instead of one of the pool's 64 templates (reaches "
                        "per-token and per-prompt caches; the request run alone is computed per request)")
    p.add_argument("--long-prompt", type=int, default=1024, metavar="N",
                   help="prompts of the `long` kind: N/2..N tokens, at most half the context (default 1024)")
    p.add_argument("--interval", type=parse_duration, help="seconds between progress lines (default: duration/20, 5..60)")
    p.add_argument("--no-oracle", action="store_true", help="skip the comparison with the request run alone")
    p.add_argument("--warmup", type=float, default=0.25, help="fraction of the run before the leak fit starts")
    p.add_argument("--leak-bytes-per-request", type=float, default=512.0,
                   help="memory slope above which (with >= 1 MiB fitted growth) a leak is reported")
    p.add_argument("--request-timeout", type=float, default=120.0, help="a request with no terminal event by then "
                                                                        "is a violation")
    p.add_argument("--json", action="store_true", help="JSON Lines: a sample per interval, then the verdict")
    p.add_argument("--tracemalloc", metavar="DIR",
                   help="trace the daemon's and workers' allocations, write a heap snapshot to DIR at every "
                        "progress line and print each process's heap diff after warm-up (slow; debugging)")
    g = p.add_argument_group("model switching and faults")
    g.add_argument("--switch-every", type=parse_every, metavar="PERIOD",
                   help="replace / rollback the served model every PERIOD: a duration (300, 5m) or a count of "
                        "requests finished since the last switch (400req)")
    g.add_argument("--fault-every", type=parse_every, metavar="PERIOD", help="inject a fault every PERIOD (as above)")
    g.add_argument("--faults", default=",".join(FAULTS), metavar="NAME,...",
                   help=f"the faults, taken in turn (default {','.join(FAULTS)})")
    g.add_argument("--switches", type=int, metavar="N",
                   help="end one period after the N-th switch is answered (--duration then only limits the run)")
    g.add_argument("--switch-timeout", type=float, default=600.0, help="seconds a switch may take to be answered")
    g.add_argument("--fault-timeout", type=float, default=60.0, help="seconds a fault may take to recover")
    return p


class Soak:
    def __init__(self, a: argparse.Namespace, endpoint: str, model: dict, daemon_pid: int | None,
                 packages: dict[str, str] | None = None, gens=None, chips: int = 1) -> None:
        from tools.soak.mix import Expected, TemplateMaker, templates

        self.a = a
        self.endpoint = endpoint
        self.model = model
        maker = TemplateMaker(model, max_tokens=a.max_tokens, prompt_ids=a.prompt_ids, long_prompt=a.long_prompt)
        self.pool = templates(model, maker=maker)
        self.fresh = maker if a.fresh_prompts else None  # it goes on making templates after the pool
        use_oracle = not a.no_oracle and (a.endpoint is None or model.get("backend") != "ref")
        self.expected = Expected(model, use_oracle)
        # switching: the tokens each package must produce, and which generation serves which package
        self.by_package = {name: Expected(model, use_oracle, path) for name, path in (packages or {}).items()}
        self.gens = gens
        self.chips = chips
        self.switch_rows: list[dict] = []
        self.faults: list = []
        self.fault_rows: list[dict] = []
        self.round_samples: list[Sample] = []
        self.round_rows: list[dict] = []
        self.lost = self.duplicated = self.failed_by_fault = self.across_switch = 0
        self.done_by_generation: dict[str, int] = {}
        self.rng = random.Random(a.seed)
        every = 0.5 if a.switches else max(0.5, min(5.0, a.duration / 200))
        self.sampler = Sampler(daemon_pid, every_s=every)
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
        self.heap = None  # tools.soak.heap.HeapDumps with --tracemalloc
        self.piece_cache: dict | None = None  # the board's token-bytes cache at the end (its `stats`)
        self.ring_layouts: dict | None = None  # chip -> the daemon's ring-end layout caches at the end
        self.heap_trim: dict | None = None  # the daemon's malloc_trim figures at the end (board.malloc_trim_interval_s)

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
        self.lost += not tr.terminals
        self.duplicated += len(tr.terminals) > 1 or tr.after_terminal > 0
        allow: frozenset[int] = frozenset()
        if self.gens is None:
            want = self.expected.tokens(tmpl, keep=self.fresh is None)
        else:
            want = self._switching_checks(tr, tmpl)
            if term is not None and term["ev"] == "error" and term.get("code") == 500 and self._in_worker_fault(tr):
                allow = frozenset({500})
                self.failed_by_fault += 1
        self.checked_oracle += want is not None
        for v in check(tr, tmpl, want, allow):
            self.violate(v, request=tr.rid, kind=tr.kind, template=tmpl.key)
        if tr.ttft_ms is not None and tr.kind in ("normal", "prefix", "long"):
            self.window_ttft.append(tr.ttft_ms)
        if tr.tpot_ms is not None and tr.kind in ("normal", "prefix", "long"):
            self.window_tpot.append(tr.tpot_ms)

    def _switching_checks(self, tr, tmpl) -> list[int] | None:
        """The generation contract for `tr` (pinned: the one published when it was sent, or either side of a
        switch under way then), and the tokens it must have: its generation's package's."""
        term = tr.terminal
        if term is not None and tr.done_at is not None and any(
                s.answered is not None and tr.sent < s.answered < tr.done_at for s in self.gens.switches):
            self.across_switch += 1
        gen = term.get("generation") if term is not None and term["ev"] == "done" else None
        self.done_by_generation[str(gen)] = self.done_by_generation.get(str(gen), 0) + (term is not None
                                                                                     and term["ev"] == "done")
        if gen is not None:
            allowed = self.gens.allowed(tr.sent)
            if allowed is not None and gen not in allowed:
                self.violate(f"ran on generation {gen}, but generation(s) {sorted(allowed)} served the alias when "
                             f"it was sent", request=tr.rid, kind=tr.kind)
            pkg = self.gens.package_of.get(gen)
            if pkg in self.by_package:
                return self.by_package[pkg].tokens(tmpl, keep=self.fresh is None)
        # no generation named (an error) or not known yet: the package whose tokens it streamed
        cands = [e.tokens(tmpl, keep=self.fresh is None) for e in self.by_package.values()]
        if not cands or cands[0] is None:
            return None
        return next((c for c in cands if c[:len(tr.tokens)] == tr.tokens), cands[0])

    def _in_worker_fault(self, tr) -> bool:
        """Did `tr` end (500) while a worker fault was under way (or within 2 s of its recovery)?"""
        t = tr.done_at or time.monotonic()
        return any(f.name in WORKER_FAULTS and f.started <= t <= (f.ended or float("inf")) + 2.0 for f in self.faults)

    def round_end(self, final: bool = False) -> None:
        """Wait for a settled board, then take the round's sample (see `tools.soak.rounds`); blocking."""
        from tools.soak.resources import measure
        from tools.soak.rounds import wait_settled
        from tools.soak.switches import ALIAS

        why = wait_settled(self.endpoint, ALIAS, self.chips, self.daemon_pid, 60.0)
        if why is not None:
            self.violate(f"round {len(self.round_rows) + 1}: the board did not settle within 60 s: {why}")
        now = time.monotonic() - self.t0
        v = measure(self.daemon_pid)
        self.round_samples.append(Sample(round(now, 3), self.finished, v))
        row = {"round": len(self.round_rows) + 1, "t_s": round(now, 1), "requests": self.finished,
               "switches": len(self.switch_rows), "faults": len(self.fault_rows), "final": final,
               "daemon_anon_rss_mb": round(v["daemon_anon_rss"] / 2**20, 2),
               "workers_anon_rss_mb": round(v["workers_anon_rss"] / 2**20, 2),
               "daemon_fds": v["daemon_fds"], "workers_fds": v["workers_fds"], "daemon_threads": v["daemon_threads"],
               "children": v["children"], "shm_objects": v["shm_objects"], "shm_mb": round(v["shm_bytes"] / 2**20, 1),
               "settled": why is None}
        self.round_rows.append(row)
        self.event("round", row, f"round {row['round']:>3} at {row['t_s']:>7.0f}s  {row['requests']:>7} req  "
                                 f"anon RSS {row['daemon_anon_rss_mb']}+{row['workers_anon_rss_mb']} MB  fds "
                                 f"{row['daemon_fds']}+{row['workers_fds']}  threads {row['daemon_threads']}  "
                                 f"workers {row['children']}  shm {row['shm_objects']} ({row['shm_mb']} MB)"
                                 + ("" if why is None else f"  NOT SETTLED: {why}"))

    def event(self, kind: str, row: dict, line: str) -> None:
        if self.a.json:
            from tools.json_lines import emit

            emit(kind, row)
        print(f"soak {line}", file=sys.stderr, flush=True)

    async def operate(self, end: float, stop: asyncio.Event) -> None:
        """Switches and faults on their schedules, one at a time, until the end (or the last switch)."""
        from tools.soak.faults import Fault, inject

        a = self.a
        names = [n.strip() for n in a.faults.split(",") if n.strip()]
        sw_t = f_t = time.monotonic()
        sw_r = f_r = 0
        while not stop.is_set() and time.monotonic() < end:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            if a.switch_every is not None and a.switch_every.due(sw_t, sw_r, now, self.finished):
                if a.switches and len(self.switch_rows) >= a.switches:
                    stop.set()  # the last generation has had its round too
                    return
                await asyncio.to_thread(self.round_end)
                s = await asyncio.to_thread(self.gens.switch, self.endpoint, a.switch_timeout)
                row = s.row(self.t0)
                self.switch_rows.append(row)
                if s.error is not None:
                    self.violate(f"switch {s.n} ({s.op}) failed: {s.error}")
                self.event("switch", row, f"switch {s.n:>3} {s.op:<8} generation {s.old_generation} -> "
                                          f"{s.new_generation} ({s.package})  {row['seconds']} s"
                                          + (f"  FAILED: {s.error}" if s.error else ""))
                sw_t, sw_r = time.monotonic(), self.finished
            now = time.monotonic()
            if a.fault_every is not None and names and a.fault_every.due(f_t, f_r, now, self.finished):
                n = len(self.fault_rows) + 1
                f = Fault(n, names[(n - 1) % len(names)], now)
                self.faults.append(f)  # 500s from now until it has recovered are the fault's
                await asyncio.to_thread(inject, f, self.endpoint, self.chips, a.fault_timeout)
                row = f.row(self.t0)
                self.fault_rows.append(row)
                if not f.recovered:
                    self.violate(f"fault {n} ({f.name}) not recovered: {f.detail}")
                self.event("fault", row, f"fault  {n:>3} {f.name:<14} {f.detail}  recovery "
                                         f"{row['recovery_s']} s")
                f_t, f_r = time.monotonic(), self.finished

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
               # to the byte as well: a slow real model's round grows by less than the MiB figure's 0.1
               "daemon_anon_rss_bytes": int(s.get("daemon_anon_rss", 0)),
               "workers_anon_rss_bytes": int(s.get("workers_anon_rss", 0)),
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

        stop = asyncio.Event()

        async def slot() -> None:
            while time.monotonic() < end and not stop.is_set():
                tmpl, kind, extra = pick(self.rng, self.pool, self.fresh)
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
                    if self.heap is not None:
                        self.heap.request(now - self.t0)

        watcher = asyncio.get_running_loop().create_task(watch())
        operator = None
        try:
            slots = [asyncio.get_running_loop().create_task(slot()) for _ in range(a.concurrency)]
            if a.switch_every is not None or a.fault_every is not None:
                operator = asyncio.get_running_loop().create_task(self.operate(end, stop))
            done, _ = await asyncio.wait([*slots, watcher], return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:  # the daemon died: stop the load
                stop.set()
                for s in slots:
                    s.cancel()
            await asyncio.gather(*slots, return_exceptions=True)
            if operator is not None:
                stop.set()
                await asyncio.gather(operator, return_exceptions=True)
            await asyncio.sleep(1.2)  # the last grace period: anything sent after a terminal event shows now
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            for _, tr, tmpl in pending:
                self.account(tr, tmpl)
            for ev in load.unknown_events:
                self.violate("event for an unknown or long-finished request id", event=str(ev)[:200])
            self.sampler.maybe_sample(self.finished)
            self.print_sample(self.sample_line(final=True))
            if self.heap is not None:
                self.heap.request(time.monotonic() - self.t0)
                await asyncio.to_thread(self.heap.wait_written)
            if self.gens is not None and watcher not in done:
                await asyncio.to_thread(self.round_end, True)
        finally:
            if operator is not None and not operator.done():
                operator.cancel()
            await load.close()

    def verdict(self, teardown: list[str]) -> dict:
        for t in teardown:
            self.violate(t)
        th = LeakThresholds(rss_bytes_per_request=self.a.leak_bytes_per_request, warmup_fraction=self.a.warmup)
        extra: dict = {}
        if self.daemon_pid is None:
            leaks = {"enough_samples": False}
        elif self.gens is None:
            from tools.soak.rounds import per_worker

            leaks = leak_verdict(self.sampler.samples, th)
            extra = {"worker_leaks": per_worker(self.sampler.samples, th)}
            if any(w.get("leak") for w in extra["worker_leaks"]):
                leaks = {**leaks, "leak": True}
        else:  # workers and rings come and go with switches: fitted per round and per worker process instead
            from tools.soak.rounds import per_switch, per_worker

            leaks = leak_verdict(self.sampler.samples, th, memory=("daemon_anon_rss",),
                                 counts=("daemon_fds", "daemon_threads"))
            round_leaks = leak_verdict(self.round_samples, th)
            workers = per_worker(self.sampler.samples, th)
            extra = {"switches": self.switch_rows, "faults": self.fault_rows, "rounds": self.round_rows,
                         "round_leaks": round_leaks, "worker_leaks": workers,
                         "per_switch": per_switch(self.round_samples, self.a.warmup),
                         "switches_answered": sum(1 for r in self.switch_rows if r["error"] is None),
                         "faults_recovered": sum(1 for r in self.fault_rows if r["recovered"]),
                         "failed_by_fault": self.failed_by_fault, "across_switch": self.across_switch,
                         "done_by_generation": {k: v for k, v in self.done_by_generation.items() if v}}
            if round_leaks.get("leak") or any(w.get("leak") for w in workers):
                leaks = {**leaks, "leak": True}
        if self.heap is not None:
            extra["heap_diffs"] = self.heap.diffs(leaks.get("warmup_s", 0.0))
        if self.piece_cache is not None:
            extra["piece_cache"] = self.piece_cache
        if self.ring_layouts:
            extra["ring_layouts"] = self.ring_layouts
        if self.heap_trim is not None:
            extra["heap_trim"] = self.heap_trim
        fail = bool(self.violation_count) or bool(leaks.get("leak"))
        return {"verdict": "fail" if fail else "pass", "requests": self.finished,
                "lost": self.lost, "duplicated": self.duplicated, **extra,
                "violations": self.violations, "violation_count": self.violation_count,
                "leaks": leaks, "errors_by_code": dict(self.errors_by_code),
                "finish_reasons": dict(self.finish_reasons), "by_kind": dict(self.by_kind),
                "checked_against_oracle": self.checked_oracle, "duration_s": round(time.monotonic() - self.t0, 1),
                "backend": self.model.get("backend"), "concurrency": self.a.concurrency,
                "timeline": self.timeline}


def main(argv: list[str]) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.concurrency < 1 or a.chips < 1 or a.duration <= 0 or a.prompt_ids < 2 or a.max_tokens < 1 \
            or a.long_prompt < 2:
        print("npuserve soak: --concurrency, --chips, --duration, --max-tokens must be positive, --prompt-ids and "
              "--long-prompt at least 2", file=sys.stderr)
        return 2
    switching = a.switch_every is not None or a.fault_every is not None
    bad = [n for n in a.faults.split(",") if n.strip() and n.strip() not in FAULTS]
    if bad:
        p.error(f"--faults: unknown {bad}; choose from {', '.join(FAULTS)}")
    if a.tracemalloc and a.endpoint:
        p.error("--tracemalloc needs the soak's own daemon (no --endpoint)")
    if switching and a.endpoint:
        p.error("--switch-every / --fault-every need the soak's own daemon (no --endpoint)")
    if a.package and (a.endpoint or switching):
        p.error("--package is for the soak's own one-model daemon (not with --endpoint or --switch-every)")
    if a.switches is not None and (a.switch_every is None or a.switches < 1):
        p.error("--switches N needs --switch-every and N >= 1")
    from tools.load import local_daemon

    d = None
    root_parent = None
    try:
        packages, extra, settings, env = None, [], list(a.set), None
        if a.tracemalloc:
            from tools.soak import heap

            settings, env = [*heap.SETTINGS, *settings], heap.env(a.tracemalloc)
        if switching:
            import tempfile

            from tools.soak.switches import ALIAS, model_root

            root_parent = tempfile.mkdtemp(prefix="nps-models-", dir="/tmp")
            root = model_root(root_parent)
            packages = {"a": os.path.join(root, "a"), "b": os.path.join(root, "b")}
            extra = ["--model-root", root, "--model", f"{ALIAS}=a"]
            # the faults, not the schedule of restarts, decide when a chip gives up (later --set wins)
            settings = ["recovery.max_resets_per_10min=1000", *settings]
        if a.package:
            extra = ["--package", os.path.abspath(a.package)]
        if a.endpoint:
            endpoint = a.endpoint
        else:
            d = local_daemon.start(backend=a.backend, chips=a.chips, settings=settings,
                                   backend_options=a.backend_option, prefix="nps-", extra=extra, env=env)
            endpoint = d.endpoint
        health = local_daemon.wait_healthy(endpoint, d, chips_up=1 if a.endpoint else a.chips)
        pid = d.pid if d else health.get("pid")
        if pid is not None and not os.path.exists(f"/proc/{pid}"):
            pid = None  # a remote endpoint: no resource trend
        print(f"npuserve soak: {a.duration:.0f} s against {endpoint} ({health['model'].get('backend')} backend, "
              f"{len(health.get('chips', []))} chips), {a.concurrency} requests outstanding"
              + (f", a switch every {a.switch_every}" if a.switch_every else "")
              + (f", a fault every {a.fault_every} ({a.faults})" if a.fault_every else "")
              + (f", until {a.switches} switches" if a.switches else ""), file=sys.stderr)
        gens = None
        if switching:
            from tools.soak.switches import Generations

            gens = Generations(int(health["model"]["generation"]), "a")
        soak = Soak(a, endpoint, health["model"], pid, packages, gens, a.chips)
        if a.tracemalloc and pid is not None:
            from tools.soak.heap import HeapDumps

            soak.heap = HeapDumps(a.tracemalloc, pid)
        asyncio.run(soak.run())
        workers = []
        if d is not None:
            try:
                workers = [c["pid"] for c in local_daemon.wait_healthy(endpoint, d, timeout=10)["chips"] if c.get("pid")]
            except SystemExit:
                pass
        try:
            st = local_daemon.stats(endpoint)
            soak.piece_cache, soak.heap_trim = st.get("piece_cache"), st.get("heap_trim")
            soak.ring_layouts = {str(c["chip"]): c["ring_layouts"] for c in st.get("chips") or [] if c.get("ring_layouts")}
        except Exception:  # noqa: BLE001 - a balancer or an older board answers no such figure: nothing to report
            pass
        res = soak.verdict(d.stop_and_check(workers) if d is not None else [])
    finally:
        if d is not None:
            if d.exit_code not in (None, 0):
                sys.stderr.write(f"daemon log tail:\n{d.log_tail()}\n")
            d.cleanup()
        if root_parent is not None:
            import shutil

            shutil.rmtree(root_parent, ignore_errors=True)
    if a.json:
        from tools.json_lines import emit

        emit("verdict", res)
    leaks = res["leaks"]
    flagged = [k for k, v in leaks.items() if isinstance(v, dict) and v.get("leak")]
    out = sys.stderr if a.json else sys.stdout
    if "rounds" in res:
        from tools.soak.report import print_tables

        print_tables(res, out)
    elif leaks.get("enough_samples"):
        from tools.soak.report import print_process_slopes

        print_process_slopes(res, out)
    workers = (f"workers {leaks['workers_anon_rss']['per_request']:.0f} B/request" if "workers_anon_rss" in leaks
               else "workers: per process, above")
    print(f"soak: {res['verdict'].upper()}: {res['requests']} requests in {res['duration_s']} s, "
          f"{res['violation_count']} violations, {res['lost']} lost, {res['duplicated']} duplicated, "
          f"errors {res['errors_by_code'] or 'none'}, "
          f"finish reasons {res['finish_reasons']}, {res['checked_against_oracle']} compared with the request run alone; "
          + (f"{res['switches_answered']} of {len(res['switches'])} switches answered, {res['faults_recovered']} of "
             f"{len(res['faults'])} faults recovered ({res['failed_by_fault']} requests failed by them); "
             if "rounds" in res else "")
          + ("leak fit: not enough samples" if not leaks.get("enough_samples") else
             f"leaks {flagged or 'none'} (daemon anon RSS {leaks['daemon_anon_rss']['per_request']:.0f} B/request, "
             f"{workers} after {leaks['warmup_s']} s warm-up)"),
          file=out)
    if res.get("heap_diffs"):
        from tools.heap_diff import format_diff

        for hd in res["heap_diffs"]:
            print(format_diff(hd, f"heap of {hd['role']} (pid {hd['pid']}), snapshot {hd['from_snapshot']} to "
                                  f"{hd['snapshots']}"), file=out)
    for v in res["violations"][:10]:
        print(f"  violation at {v['t_s']} s: {v['what']}", file=sys.stderr)
    return 0 if res["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
