"""What every chaos scenario shares: its result row, a daemon under load, and the invariant checks.

A scenario starts its own daemon (`tools.load.local_daemon`), puts load on it
with `tools.load.wire_load.WireLoad` (which sees every event on the wire),
injects its fault, and then checks the same invariants as the soak: every
request got exactly one terminal event and nothing after it, the outcomes
are the ones the fault allows, the daemon serves fresh requests afterwards,
and a SIGTERM leaves no worker and no /dev/shm object behind.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tools.load import local_daemon
from tools.load.wire_load import Trace, WireLoad

# On a loaded 2-core machine a healthy worker can miss the default 1 s heartbeat; a scenario's own fault,
# not the machine, should be what takes a chip down (later settings override these).
TOLERANT = ("recovery.heartbeat_timeout_ms=8000", "recovery.max_resets_per_10min=20")
# A sim chip whose decode steps take 5 ms: requests stay in flight long enough to be hit by a fault.
SLOW_SIM = ("decode_base_ms=5.0", "decode_per_lane_ms=0.0")


@dataclass
class ScenarioResult:
    scenario: str
    passed: bool = True
    requests: int = 0
    faults: int = 0
    recovery_s: float | None = None
    details: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.passed = False
        self.problems.append(what)

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.fail(what)

    def row(self) -> dict:
        return {"scenario": self.scenario, "passed": self.passed, "requests": self.requests, "faults": self.faults,
                "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 3),
                "details": {**self.details, "problems": self.problems}}


def terminal_codes(traces: list[Trace]) -> dict[str, int]:
    """Terminal events by outcome: `done:<finish_reason>` or `error:<code>`, `none` when missing."""
    out: dict[str, int] = {}
    for t in traces:
        term = t.terminal
        k = "none" if term is None else (f"done:{term.get('finish_reason')}" if term["ev"] == "done"
                                         else f"error:{term.get('code')}")
        out[k] = out.get(k, 0) + 1
    return out


def check_traces(res: ScenarioResult, traces: list[Trace], allowed_errors: set[int], full_length: bool = True) -> None:
    """Exactly one terminal event each, nothing after it, only `allowed_errors`; done = every token."""
    for t in traces:
        for v in t.wire_violations(full_length):
            res.fail(f"request {t.rid}: {v}")
        term = t.terminal
        if term is not None and term["ev"] == "error" and term.get("code") not in allowed_errors:
            res.fail(f"request {t.rid}: error {term.get('code')} {term.get('reason')} not expected here")
        if len(res.problems) > 20:
            break
    res.details["terminal"] = terminal_codes(traces)


def wait_until(pred, timeout: float, every: float = 0.05):
    """Poll `pred()` until it returns something truthy; (value, seconds waited) or (None, timeout)."""
    t0 = time.monotonic()
    while True:
        v = pred()
        if v:
            return v, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return None, timeout
        time.sleep(every)


def health(endpoint: str, timeout: float = 5.0) -> dict | None:
    from engine.client import Client
    from engine.errors import ClientError

    try:
        with Client(endpoint, timeout=timeout) as c:
            return c.health()
    except ClientError:
        return None


def serves_fresh_requests(res: ScenarioResult, endpoint: str, n: int = 8) -> None:
    """After the fault: `n` new requests all finish."""
    from engine.client import Client
    from engine.errors import ClientError

    try:
        with Client(endpoint, timeout=30) as c:
            for i in range(n):
                r = c.generate([3, 4, 5 + i], max_tokens=4, seed=i)
                res.expect(r.finish_reason == "length" and len(r.tokens) == 4, f"fresh request {i}: {r}")
    except ClientError as e:
        res.fail(f"fresh request after the fault failed: {e}")


async def stream_all(load: WireLoad, n: int, max_tokens: int, prompt_len: int = 3, timeout: float = 120.0,
                     **fields) -> list[Trace]:
    """Start `n` streams at once and wait for all of them (those unfinished at `timeout` stay open)."""
    traces = [await load.start([1 + (i + k) % 200 for k in range(prompt_len)], max_tokens=max_tokens, seed=i,
                               ignore_eos=True, **fields) for i in range(n)]
    await asyncio.gather(*(load.finished(t, timeout) for t in traces))
    return traces


class DaemonUnderTest:
    """`with DaemonUnderTest(res, backend=..., ...) as d:` a started, healthy daemon; on exit the teardown checks."""

    def __init__(self, res: ScenarioResult, *, backend: str = "stub", chips: int = 1, settings=(),
                 backend_options=(), extra=()) -> None:
        self.res = res
        self.d = local_daemon.start(backend=backend, chips=chips, settings=[*TOLERANT, *settings],
                                    backend_options=list(backend_options), prefix="npc-", extra=extra)
        self.workers: list[int] = []

    def __enter__(self) -> "DaemonUnderTest":
        try:
            h = local_daemon.wait_healthy(self.d.endpoint, self.d, timeout=90, chips_up=1)
        except SystemExit as e:
            self.d.cleanup()
            raise RuntimeError(str(e)) from None
        self.health = h
        self.workers = [c["pid"] for c in h["chips"] if c.get("pid")]
        return self

    @property
    def endpoint(self) -> str:
        return self.d.endpoint

    def chip(self, i: int) -> dict:
        h = health(self.endpoint)
        return h["chips"][i] if h else {}

    def __exit__(self, *exc) -> None:
        try:
            h = health(self.endpoint, timeout=2)
            pids = [c["pid"] for c in (h or {}).get("chips", []) if c.get("pid")]
            for p in self.d.stop_and_check([*self.workers, *pids]):
                self.res.fail(p)
            if self.res.problems:
                self.res.details["daemon_log_tail"] = self.d.log_tail(1500)
        finally:
            self.d.cleanup()
