"""Run the selected checks against one endpoint and collect a verdict per check.

A check passes when it returns and none of its connections saw a frame that
breaks the framing rules (`wire.Connection.violations`): the one-event-per-
message rule is thus held against every message of the run, not only in the
check named for it.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

import zmq

from tools.conformance.env import Env, Options, op
from tools.conformance.registry import CHECKS, Check
from tools.conformance.shapes import Fail, Skip
from tools.conformance.target import Target, target_from_health
from tools.conformance.wire import WireTimeout, open_connection


class Unreachable(Exception):
    """The endpoint did not answer `health`: nothing can be checked."""


@dataclass
class Result:
    name: str
    status: str  # "pass", "fail", "skip"
    detail: str
    duration_s: float
    needs: str | None = None


@dataclass
class Run:
    endpoint: str
    target: Target | None
    results: list[Result] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(1 for r in self.results if r.status == status)

    @property
    def ok(self) -> bool:
        return self.count("fail") == 0


def selected(opts: Options) -> list[Check]:
    names = {c.name for c in CHECKS}
    unknown = sorted((set(opts.only) | set(opts.skip)) - names)
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; the checks are: {', '.join(sorted(names))}")
    return [c for c in CHECKS if (not opts.only or c.name in opts.only) and c.name not in opts.skip]


def probe(ctx: zmq.Context, opts: Options) -> Target:
    c = open_connection(ctx, opts.endpoint, opts.timeout_s, opts.curve)
    try:
        ev = c.request(op("health", "conformance-probe"), timeout_s=min(opts.timeout_s, 10.0))
    except WireTimeout:
        raise Unreachable(f"no health reply from {opts.endpoint}: is the daemon or balancer running there, and is "
                          "the endpoint right (ipc://PATH or tcp://HOST:PORT)? `npuserve health --endpoint "
                          f"{opts.endpoint}` asks the same; a CURVE endpoint needs --curve-secret-key and "
                          "--curve-server-key") from None
    finally:
        c.close()
    if ev.get("ev") != "health":
        raise Unreachable(f"{opts.endpoint} answered health with {ev!r}")
    try:
        return target_from_health(ev, opts.kind)
    except ValueError as e:
        raise Unreachable(f"{opts.endpoint}: {e}") from None


def settle(connections, settle_s: float) -> list[dict]:
    """What arrives on the check's connections within `settle_s` after it ended (expected: nothing).

    Every check waits for the terminal event of each request it sent, so a
    late event here is a second terminal event, or an event after one, or a
    reply to a cancel. Absence can only be watched for a while: a short
    window catches what a server sends in the same turn as the terminal one.
    """
    late = [e for c in connections for e in c.inbox]
    poller = zmq.Poller()
    for c in connections:
        poller.register(c.sock, zmq.POLLIN)
    deadline = time.monotonic() + settle_s
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(int(left * 1000) + 1))
        for c in connections:
            if c.sock in ready:
                late += c.recv_message(0)
    return late


def run_check(check: Check, env: Env) -> Result:
    env.check = check.name
    t0 = time.monotonic()
    status, detail = "pass", ""
    try:
        detail = check.run(env) or ""
    except Skip as e:
        status, detail = "skip", str(e)
    except Fail as e:
        status, detail = "fail", str(e)
    except WireTimeout as e:
        status, detail = "fail", f"timed out: {e}"
    except Exception as e:  # a crash of the check is a failed check, with where it happened
        where = traceback.extract_tb(e.__traceback__)[-1]
        status, detail = "fail", f"{type(e).__name__}: {e} (at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})"
    if status == "pass":
        late = settle(env.connections, env.opts.settle_s)
        if late:
            status, detail = "fail", (f"{len(late)} event(s) after every request of the check had ended: "
                                      f"{[(e['ev'], e.get('id')) for e in late][:4]}")
    violations = [v for c in env.connections for v in c.violations]
    if violations and status != "fail":
        status, detail = "fail", f"{violations[0]} ({len(violations)} violation(s) in this check)"
    env.close_all()
    return Result(check.name, status, detail, time.monotonic() - t0, check.needs)


def run(opts: Options, on_result=None) -> Run:
    """Probe the endpoint, run each selected check, call `on_result(result)` as each ends."""
    checks = selected(opts)
    ctx = zmq.Context()
    try:
        target = probe(ctx, opts)
        out = Run(opts.endpoint, target)
        for check in checks:
            r = run_check(check, Env(opts, target, ctx))
            out.results.append(r)
            if on_result is not None:
                on_result(r)
        return out
    finally:
        ctx.term()
