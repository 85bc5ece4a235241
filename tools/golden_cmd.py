"""`npuserve golden --endpoint E --package DIR [--model ALIAS] [--json]`: a package's golden cases against a live server.

Each case of the package's golden.json is sent as one generate request (its
prompt ids, max_tokens, ignore_eos and sampling fields as recorded) to the
daemon or balancer at E, and the answer is judged by `engine.core.golden_check`,
the comparison the daemon runs on a new generation before publishing it.
Prints a table (or with --json one object per case, then a summary object);
exit 0 when every case passed, 1 when any failed, 2 when the package or the
server cannot be used (with what to do next).
"""

from __future__ import annotations

import argparse
import sys

import orjson

from engine.client import Client, default_endpoint
from engine.core.golden_check import GoldenReport, Outcome, case_name, check_cases, golden_request
from engine.errors import ClientError, ClientTimeout, ModelNotFound
from workers.package_loader import load_package
from workers.package_manifest import PackageError

PROG = "npuserve golden"


class Unusable(Exception):
    """The run cannot go on (no server, unknown model): not a verdict on the package."""


def _served_sha256(client: Client, alias: str | None) -> str | None:
    """The sha256 of the model the endpoint serves under `alias` (its default when None), if it says."""
    try:
        models = client.call("models").get("models") or []
    except ClientError:
        return None  # a server without `models` (or one that refuses it) can still be checked
    for m in models:
        if (alias is None and (m.get("default") or len(models) == 1)) or m.get("alias") == alias:
            return m.get("sha256")
    return None


def run_cases(client: Client, cases: list[dict], alias: str | None, progress=None) -> list[Outcome]:
    """Send each case and collect its outcome; a request the server rejects is that case's failure."""
    outcomes = []
    for i, case in enumerate(cases):
        if progress:
            progress(i, case)
        try:
            r = client.generate(case["prompt"], model=alias, **{k: v for k, v in golden_request(case).items()
                                                                if k != "prompt"})
            outcomes.append(Outcome(tuple(r.tokens), r.finish_reason))
        except ClientTimeout as e:
            raise Unusable(f"no answer from {client.endpoint} within {client.timeout} s ({e.message or e}); is a "
                           f"server running there? (npuserve health --endpoint {client.endpoint}); "
                           f"a slow model may need a larger --timeout") from None
        except ModelNotFound as e:
            raise Unusable(f"{e.message}; list the served models with "
                           f"`npuserve admin --endpoint {client.endpoint} models` and pass --model ALIAS") from None
        except ClientError as e:  # e.g. 400: prompt ids outside the served vocabulary (the wrong model)
            outcomes.append(Outcome(error=str(e)))
    return outcomes


def format_table(report: GoldenReport) -> str:
    rows = [("case", "status", "tokens", "reason")]
    for v in report.verdicts:
        got = "-" if v.got is None else str(len(v.got))
        rows.append((v.name, v.status.value.upper(), f"{got}/{len(v.expected)}", v.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3]).rstrip() for r in rows]
    return "\n".join(lines + ["", ("ok: " if report.ok else "FAILED: ") + report.summary])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", default=None, help="daemon or balancer endpoint (default: the local board's)")
    ap.add_argument("--package", required=True, help="model package directory whose golden.json to run")
    ap.add_argument("--model", default=None, help="model alias to send the requests to (default: the server's)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    ap.add_argument("--tie-gap", type=float, default=0.0,
                    help="a mismatching case whose recorded min_top2_gap is below this is skipped as a near-tie "
                         "(default 0: every mismatch fails)")
    ap.add_argument("--json", action="store_true", help="one JSON object per case, then a summary object")
    a = ap.parse_args(argv)
    try:
        pkg = load_package(a.package)
    except PackageError as e:
        print(f"{PROG}: {e}\n(check the path; `npuserve check-package DIR` verifies a package offline)",
              file=sys.stderr)
        return 2
    cases = pkg.golden()
    endpoint = a.endpoint or default_endpoint()
    say = (lambda i, c: print(f"\r{PROG}: case {i + 1}/{len(cases)} ({case_name(c, i)}) ...", end="",
                              file=sys.stderr, flush=True)) if sys.stderr.isatty() and not a.json else None
    try:
        with Client(endpoint, timeout=a.timeout) as client:
            served = _served_sha256(client, a.model)
            outcomes = run_cases(client, cases, a.model, progress=say)
    except Unusable as e:
        print(("\n" if say else "") + f"{PROG}: {e}", file=sys.stderr)
        return 2
    if say:
        print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    if served and served != pkg.sha256:
        print(f"{PROG}: note: the server's model has sha256 {served[:16]}..., this package {pkg.sha256[:16]}...: "
              f"checking another package's golden cases", file=sys.stderr)
    report = check_cases(cases, outcomes, pkg.eos_ids, tie_gap=a.tie_gap)
    if a.json:
        out = sys.stdout.buffer
        for v in report.verdicts:
            out.write(orjson.dumps(v.to_dict()) + b"\n")
        out.write(orjson.dumps({"summary": True, "package": pkg.path, "sha256": pkg.sha256, "endpoint": endpoint,
                                "model": a.model, **report.to_dict()}) + b"\n")
    else:
        print(format_table(report))
    return 0 if report.ok else 1
