"""`npuserve install-monitoring --out DIR`: Prometheus's scrape config, rules, rule tests and a Grafana dashboard.

Writes prometheus.yml, npuserve.rules.yml, npuserve.rules.test.yml and
grafana-dashboard.json into DIR (created if needed; existing files of those
names are replaced: they are generated). Check them with
`promtool check config DIR/prometheus.yml` and
`promtool test rules DIR/npuserve.rules.test.yml`. docs/observability.md
("Monitoring a deployment") lists the alerts and what to do for each.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from tools.monitoring import dashboard, prometheus_config, rules_file, rules_tests
from tools.monitoring.alerts import ALERTS, Params
from tools.monitoring.durations import parse_seconds
from tools.monitoring.targets import BALANCER_PORT, HTTP_PORT, TargetError, parse_addresses, parse_boards

FILES = ("prometheus.yml", rules_file.RULES_NAME, "npuserve.rules.test.yml", "grafana-dashboard.json")


def parse_args(argv: list[str]) -> argparse.Namespace:
    d = Params()
    p = argparse.ArgumentParser(prog="npuserve install-monitoring", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the four files into")
    p.add_argument("--boards", metavar="LIST",
                   help="boards to scrape, comma-separated: N (board N here, /metrics on port 9400+N), "
                        "ID=HOST:PORT, or HOST:PORT (default: 0)")
    p.add_argument("--balancer", metavar="LIST",
                   help=f"balancer /metrics HOST:PORT list (default: 127.0.0.1:{BALANCER_PORT}; none: no balancer)")
    p.add_argument("--http", metavar="LIST",
                   help=f"HTTP front HOST:PORT list, its /metrics (default: 127.0.0.1:{HTTP_PORT}; none: no front)")
    p.add_argument("--host", default=None, help="the host label of local (127.0.0.1) targets (default: hostname)")
    p.add_argument("--alertmanager", action="append", default=[], metavar="HOST:PORT",
                   help="an Alertmanager to send alerts to (repeatable)")
    p.add_argument("--scrape-interval", default="15s", help="Prometheus scrape interval (default 15s)")
    p.add_argument("--evaluation-interval", default="15s", help="rule evaluation interval (default 15s)")
    p.add_argument("--rate-window", default=d.rate_window, help=f"window of the rates and quantiles "
                   f"(default {d.rate_window}; at least four scrape intervals)")
    p.add_argument("--for", dest="for_", action="append", default=[], metavar="[ALERT=]DURATION",
                   help="how long a condition must hold before its alert fires: DURATION for every alert, or "
                        "ALERT=DURATION for one (repeatable; defaults: " +
                        ", ".join(f"{a.name} {a.default_for}" for a in ALERTS) + ")")
    p.add_argument("--kv-threshold", type=float, default=d.kv_threshold, help="KV usage that counts as full")
    p.add_argument("--queue-wait-slo", type=float, default=d.queue_wait_slo_s, metavar="S",
                   help="longest acceptable admission wait, seconds")
    p.add_argument("--ttft-slo", type=float, default=d.ttft_slo_s, metavar="S",
                   help="TTFT objective's bound, seconds (a bucket bound of time_to_first_token_seconds)")
    p.add_argument("--ttft-objective", type=float, default=d.ttft_objective,
                   help="share of requests that must meet --ttft-slo (the error budget is the rest)")
    p.add_argument("--error-ratio", type=float, default=d.error_ratio, help="failed share of requests that alerts")
    p.add_argument("--preemptions-per-s", type=float, default=d.preemptions_per_s, help="preemption storm rate")
    p.add_argument("--spec-acceptance-min", type=float, default=d.spec_acceptance_min,
                   help="speculative acceptance below which it alerts")
    p.add_argument("--constraint-reject-ratio", type=float, default=d.constraint_reject_ratio,
                   help="share of constraints failing to compile that alerts")
    p.add_argument("--docs-url", default="", help="prefix of the runbook links (e.g. the repository's URL + /)")
    return p.parse_args(argv)


def _params(args: argparse.Namespace) -> Params:
    overrides: dict[str, str] = {}
    for item in args.for_:
        name, eq, dur = item.rpartition("=")
        if not eq:
            overrides.update({a.name: dur for a in ALERTS})
        else:
            overrides[name] = dur
    p = Params(rate_window=args.rate_window, kv_threshold=args.kv_threshold, queue_wait_slo_s=args.queue_wait_slo,
               ttft_slo_s=args.ttft_slo, ttft_objective=args.ttft_objective, error_ratio=args.error_ratio,
               preemptions_per_s=args.preemptions_per_s, spec_acceptance_min=args.spec_acceptance_min,
               constraint_reject_ratio=args.constraint_reject_ratio, for_overrides=overrides)
    p.check()
    if parse_seconds(p.rate_window) < 2 * parse_seconds(args.scrape_interval):
        raise ValueError(f"--rate-window {p.rate_window} must hold at least two scrapes "
                         f"(--scrape-interval {args.scrape_interval})")
    return p


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    local = args.host or socket.gethostname()
    try:
        for flag in ("scrape_interval", "evaluation_interval"):
            if parse_seconds(getattr(args, flag)) <= 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be longer than 0")
        params = _params(args)
        targets = (parse_boards(args.boards, local)
                   + parse_addresses(args.balancer, "balancer", BALANCER_PORT, local, "--balancer")
                   + parse_addresses(args.http, "front", HTTP_PORT, local, "--http"))
    except (ValueError, TargetError) as e:
        print(f"npuserve install-monitoring: {e}", file=sys.stderr)
        return 2
    texts = {
        "prometheus.yml": prometheus_config.render(targets, scrape_interval=args.scrape_interval,
                                                   evaluation_interval=args.evaluation_interval,
                                                   alertmanagers=args.alertmanager),
        rules_file.RULES_NAME: rules_file.render(params, args.docs_url),
        "npuserve.rules.test.yml": rules_tests.render(params, args.docs_url),
        "grafana-dashboard.json": dashboard.render(),
    }
    try:
        os.makedirs(args.out, exist_ok=True)
        for name in FILES:
            with open(os.path.join(args.out, name), "w") as fh:
                fh.write(texts[name])
    except OSError as e:
        print(f"npuserve install-monitoring: cannot write {args.out}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(FILES)} to {args.out}\ncheck them:\n"
          f"  promtool check config {os.path.join(args.out, 'prometheus.yml')}\n"
          f"  promtool test rules {os.path.join(args.out, 'npuserve.rules.test.yml')}\n"
          f"run: prometheus --config.file={os.path.join(args.out, 'prometheus.yml')}\n"
          f"Grafana: import grafana-dashboard.json (Dashboards > New > Import) with a Prometheus data source")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
