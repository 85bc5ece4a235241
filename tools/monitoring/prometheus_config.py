"""prometheus.yml: one scrape job per role (boards, balancers, fronts), the rules file, an optional Alertmanager."""

from __future__ import annotations

import yaml

from tools.monitoring.durations import parse_seconds, render_seconds
from tools.monitoring.rules_file import RULES_NAME
from tools.monitoring.targets import JOBS, ROLES, Target


def render(targets: list[Target], *, scrape_interval: str = "15s", evaluation_interval: str = "15s",
           alertmanagers: list[str] | None = None) -> str:
    jobs = []
    for role in ROLES:
        mine = [t for t in targets if t.role == role]
        if not mine:
            continue
        jobs.append({"job_name": JOBS[role],
                     "static_configs": [{"targets": [t.address], "labels": t.labels()} for t in mine]})
    doc: dict = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval,
                            "scrape_timeout": _timeout(scrape_interval)},
                 "rule_files": [RULES_NAME],
                 "scrape_configs": jobs}
    if alertmanagers:
        doc["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": list(alertmanagers)}]}]}
    head = ("# Written by `npuserve install-monitoring` (docs/observability.md#monitoring-a-deployment).\n"
            "# Each target is labelled role (board | balancer | front), host and, for a board, board.\n")
    return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def _timeout(interval: str) -> str:
    """Prometheus's default scrape timeout (10 s), or the interval when that is shorter (it must not exceed it)."""
    return render_seconds(min(10.0, parse_seconds(interval)))
