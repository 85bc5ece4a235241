"""`npuserve conformance ENDPOINT`: check a daemon or balancer against docs/protocol.md.

Exit 0 when every check that ran passed, 1 when one failed, 2 when the
suite could not run (endpoint unreachable, bad options).
"""

from __future__ import annotations

import argparse
import os
import sys

from tools.conformance import report
from tools.conformance.env import Options
from tools.conformance.registry import CHECKS
from tools.conformance.runner import Unreachable, run, selected
from tools.conformance.wire import load_curve_keys


def _names(values: list[str]) -> tuple[str, ...]:
    return tuple(n.strip() for v in values for n in v.split(",") if n.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="npuserve conformance",
        description="Check a daemon or balancer endpoint against the wire protocol (docs/protocol.md). "
                    "Checks that need a set-up the endpoint may not offer are skipped unless their flag is given.")
    p.add_argument("endpoint", nargs="?", help="ipc://PATH or tcp://HOST:PORT of a daemon or balancer")
    p.add_argument("--admin", action="store_true",
                   help="the endpoint grants this client admin ops (ipc://, or an admin CURVE key): check "
                        "drain/resume and 503 draining (drains the endpoint for a moment)")
    p.add_argument("--admin-denied", action="store_true",
                   help="the endpoint denies this client admin ops (plain tcp://): check 403 forbidden")
    p.add_argument("--overload", type=int, default=0, metavar="N",
                   help="send a burst of N long requests, more than the endpoint's waiting room, and check 429")
    p.add_argument("--second-model", default=None, metavar="ALIAS", help="another alias the endpoint serves")
    p.add_argument("--package", default=None, metavar="PATH",
                   help="a model package inside the endpoint's model root: with --admin, load it under a new alias, "
                        "serve a request on it and unload it (the lifecycle ops and their errors)")
    p.add_argument("--max-message-bytes", type=int, default=1 << 20, metavar="B",
                   help="the endpoint's server.max_message_bytes (default 1 MiB), for the too_large check")
    p.add_argument("--crowd", type=int, default=24, metavar="N", help="concurrent requests in the seeded crowd check")
    p.add_argument("--kind", choices=("auto", "daemon", "balancer"), default="auto",
                   help="which documented health/stats keys to expect (auto: from the health reply)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="how long to wait for any one reply or stream before failing the check (default 60)")
    p.add_argument("--settle-ms", type=float, default=100.0, metavar="MS",
                   help="after each check, watch its connections this long for events that should not come "
                        "(a second terminal event, a reply to a cancel); default 100")
    p.add_argument("--only", action="append", default=[], metavar="NAME[,NAME]", help="run only these checks")
    p.add_argument("--skip", action="append", default=[], metavar="NAME[,NAME]", help="do not run these checks")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument("--curve-secret-key", default=os.environ.get("NPUSERVE_CURVE_SECRET_KEY"), metavar="FILE",
                   help="this client's .key_secret for a CURVE tcp:// endpoint ($NPUSERVE_CURVE_SECRET_KEY)")
    p.add_argument("--curve-server-key", default=os.environ.get("NPUSERVE_CURVE_SERVER_KEY"), metavar="FILE",
                   help="the endpoint's public .key ($NPUSERVE_CURVE_SERVER_KEY)")
    p.add_argument("--json", action="store_true", help="JSON Lines: one {kind: row} per check, then {kind: summary}")
    return p


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    if a.list:
        width = max(len(c.name) for c in CHECKS)
        for c in CHECKS:
            needs = f"  (needs --{c.needs.replace('_', '-')})" if c.needs else ""
            print(f"{c.name.ljust(width)}  {c.what}{needs}")
        return 0
    if not a.endpoint:
        print("npuserve conformance: give the ENDPOINT to check (e.g. ipc:///run/npuserve/board0/d.sock or "
              "tcp://HOST:PORT); --list shows the checks", file=sys.stderr)
        return 2
    curve = None
    if a.endpoint.startswith("tcp://") and a.curve_secret_key and a.curve_server_key:
        try:
            curve = load_curve_keys(a.curve_secret_key, a.curve_server_key)
        except (OSError, ValueError) as e:
            print(f"npuserve conformance: cannot read the CURVE keys: {e} (create them with `npuserve keygen`)",
                  file=sys.stderr)
            return 2
    opts = Options(endpoint=a.endpoint, timeout_s=a.timeout, admin=a.admin, admin_denied=a.admin_denied,
                   overload=a.overload, second_model=a.second_model, package=a.package,
                   max_message_bytes=a.max_message_bytes,
                   crowd=a.crowd, kind=a.kind, settle_s=a.settle_ms / 1000, curve=curve, only=_names(a.only),
                   skip=_names(a.skip))
    if a.admin and a.admin_denied:
        print("npuserve conformance: --admin and --admin-denied contradict each other: give the one that holds "
              "for this client at this endpoint", file=sys.stderr)
        return 2
    try:
        selected(opts)
    except ValueError as e:
        print(f"npuserve conformance: {e}", file=sys.stderr)
        return 2
    out = sys.stdout
    if a.json:
        def on_result(r):
            report.json_row(r, out)
    else:
        width = max(len(c.name) for c in CHECKS)
        print(f"{'check'.ljust(width)}  {'':<4}  {'time':>7}  detail", file=out, flush=True)

        def on_result(r):
            print(report.table_line(r, width), file=out, flush=True)
    try:
        result = run(opts, on_result)
    except Unreachable as e:
        print(f"npuserve conformance: {e}", file=sys.stderr)
        return 2
    if a.json:
        report.json_summary(result, out)
    else:
        print(report.summary_line(result), file=out)
        if not result.ok:
            print("each failed check names the promise of docs/protocol.md it holds the endpoint to; rerun one "
                  "alone with --only NAME", file=sys.stderr)
    return 0 if result.ok else 1
