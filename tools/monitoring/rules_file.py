"""npuserve.rules.yml: the recording rules, then the alerts, each alert with its severity and what to do."""

from __future__ import annotations

import yaml

from tools.monitoring.alerts import ALERTS, Params, recording_rules

RULES_NAME = "npuserve.rules.yml"


def annotations(alert, docs_url: str = "") -> dict[str, str]:
    """What an alert carries besides its labels: the action (summary), the meaning, the troubleshooting anchor."""
    return {"summary": alert.action, "description": alert.meaning, "runbook_url": docs_url + alert.anchor}


def render(p: Params, docs_url: str = "") -> str:
    records = [{"record": name, "expr": expr} for name, expr in recording_rules(p)]
    alerts = [{"alert": a.name, "expr": a.expr(p), "for": p.for_(a),
               "labels": {"severity": a.severity}, "annotations": annotations(a, docs_url)} for a in ALERTS]
    doc = {"groups": [{"name": "npuserve.records", "rules": records},
                      {"name": "npuserve.alerts", "rules": alerts}]}
    head = ("# Written by `npuserve install-monitoring`: recording rules per board (board:npuserve_*) and the\n"
            "# alerts of docs/observability.md#monitoring-a-deployment. Unit tests: npuserve.rules.test.yml.\n")
    return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=120)
