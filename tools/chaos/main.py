"""`npuserve chaos --scenario NAME|all`: fault scenarios under load; exit 1 when any fails.

Each scenario starts its own daemon, injects its fault under load and checks
the invariants (one terminal event per request, only the errors the fault
allows, recovery, no leaked worker or shared memory). `--json` prints one row
per scenario: {"kind": "scenario", "scenario", "passed", "requests", "faults",
"recovery_s", "details"}.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from tools.chaos import balancer_faults, client_faults, resource_faults, worker_faults
from tools.chaos.harness import ScenarioResult

SCENARIOS = {
    "worker-kill": worker_faults.worker_kill,
    "worker-kill-inflight": worker_faults.worker_kill_inflight,
    "worker-stop": worker_faults.worker_stop,
    "backend-raises": worker_faults.backend_raises,
    "malformed-flood": client_faults.malformed_flood,
    "slow-reader": client_faults.slow_reader,
    "clients-vanish": client_faults.clients_vanish,
    "shm-full": resource_faults.shm_full,
    "kv-exhausted": resource_faults.kv_exhausted,
    "daemon-kill": balancer_faults.daemon_kill,
}


def run_one(name: str) -> ScenarioResult:
    res = ScenarioResult(name)
    t0 = time.monotonic()
    try:
        SCENARIOS[name](res)
    except Exception as e:  # a scenario that cannot run is a failed scenario, with the reason
        res.fail(f"scenario raised {type(e).__name__}: {e}")
        res.details["traceback"] = traceback.format_exc()[-2000:]
    res.details["seconds"] = round(time.monotonic() - t0, 2)
    return res


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="npuserve chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", action="append", default=[], metavar="NAME|all",
                   help=f"one of {', '.join(SCENARIOS)}, or all (repeatable)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--json", action="store_true", help="one JSON row per scenario")
    a = p.parse_args(argv)
    if a.list:
        for name, fn in SCENARIOS.items():
            print(f"{name:<20} {(fn.__doc__ or '').strip().splitlines()[0]}")
        return 0
    names = []
    for s in a.scenario or ["all"]:
        if s == "all":
            names += list(SCENARIOS)
        elif s in SCENARIOS:
            names.append(s)
        else:
            p.error(f"unknown scenario {s!r}; one of {', '.join(SCENARIOS)} or all")
    failed = 0
    for name in dict.fromkeys(names):
        print(f"chaos: {name} ...", file=sys.stderr, flush=True)
        res = run_one(name)
        failed += not res.passed
        if a.json:
            from tools.json_lines import emit

            emit("scenario", res.row())
        else:
            rec = "-" if res.recovery_s is None else f"{res.recovery_s:.2f} s"
            print(f"{'PASS' if res.passed else 'FAIL'}  {name:<20} requests {res.requests:>4}  faults {res.faults:>4}  "
                  f"recovery {rec:>8}  terminal {res.details.get('terminal', {})}  ({res.details['seconds']} s)")
            for prob in res.problems[:8]:
                print(f"      {prob}")
        if not res.passed and a.json:
            for prob in res.problems[:8]:
                print(f"chaos: {name}: {prob}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
