"""grafana-dashboard.json: one dashboard of the boards (host and board selectors), the balancer and the fronts.

Every panel is queries of the recording rules (`board:npuserve_*`) or of raw
series; `PANELS` is the single list, so the integration test can run every
query against a real Prometheus and the docs' picture is drawn from it.
Grafana template variables in the queries: `$host`, `$board` (regex
matchers, "All" = `.*`) and `$__rate_interval`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SEL = 'host=~"$host",board=~"$board"'
RAW = f'role="board",{SEL}'
FRONT = 'role="front",host=~"$host"'
BAL = 'role="balancer",host=~"$host"'
RI = "$__rate_interval"
WIDTH = 24  # Grafana's grid is 24 columns wide


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # a Grafana unit id
    queries: tuple[tuple[str, str], ...]  # (expr, legend)
    description: str = ""


def _q(prefix: str, quantiles=("0.5", "0.9", "0.99")) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}:p{round(float(q) * 100)}{{{SEL}}}", f"p{round(float(q) * 100)} {{{{host}}}}/{{{{board}}}}")
                 for q in quantiles)


PANELS: tuple[Panel, ...] = (
    Panel("Throughput", "short",
          ((f"board:npuserve_generation_tokens:rate{{{SEL}}}", "generated {{host}}/{{board}}"),
           (f"board:npuserve_prompt_tokens:rate{{{SEL}}}", "prompt {{host}}/{{board}}"))),
    Panel("Requests and errors", "reqps",
          ((f"board:npuserve_requests:rate{{{SEL}}}", "ended {{host}}/{{board}}"),
           (f"board:npuserve_errors:rate{{{SEL}}}", "failed {{host}}/{{board}}"))),
    Panel("Time to first token", "s", _q("board:npuserve_ttft_seconds")),
    Panel("Time per output token (inter-token latency)", "s", _q("board:npuserve_tpot_seconds")),
    Panel("Front: TTFT as clients see it", "s",
          ((f"histogram_quantile(0.99, sum by (host, le) (rate(npuserve:http_time_to_first_token_seconds_bucket"
            f"{{{FRONT}}}[{RI}])))", "p99 {{host}}"),
           (f"histogram_quantile(0.99, sum by (host, le) (rate(npuserve:http_added_ttft_seconds_bucket{{{FRONT}}}"
            f"[{RI}])))", "p99 added by the front {{host}}"))),
    Panel("Queue depth", "short",
          ((f"board:npuserve_requests_waiting:sum{{{SEL}}}", "waiting {{host}}/{{board}}"),
           (f"board:npuserve_requests_running:sum{{{SEL}}}", "running {{host}}/{{board}}"),
           (f'sum by (host, board, queue) (npuserve:queue_depth{{{RAW},queue!="admission"}})',
            "{{queue}} {{host}}/{{board}}"))),
    Panel("Oldest wait", "s",
          ((f"board:npuserve_admission_wait_seconds:max{{{SEL}}}", "admission {{host}}/{{board}}"),
           (f'max by (host, board, queue) (npuserve:queue_oldest_wait_seconds{{{RAW},queue!="admission"}})',
            "{{queue}} {{host}}/{{board}}"))),
    Panel("KV usage by tier", "percentunit",
          ((f"board:npuserve_kv_usage:max{{{SEL}}}", "device {{host}}/{{board}}"),
           (f"sum by (host, board, tier) (npuserve:kv_tier_blocks{{{RAW}}}) / sum by (host, board, tier) "
            f"(npuserve:kv_tier_capacity_blocks{{{RAW}}})", "{{tier}} {{host}}/{{board}}")),
          "device: blocks held over all blocks; host and disk tiers (when configured): blocks held over capacity"),
    Panel("Chip busy fraction", "percentunit",
          ((f"npuserve:chip_busy_fraction{{{RAW}}}", "chip {{chip}} {{host}}/{{board}}"),)),
    Panel("Chip idle gaps", "s",
          ((f"histogram_quantile(0.5, sum by (host, board, chip, le) (rate(npuserve:chip_idle_gap_seconds_bucket"
            f"{{{RAW}}}[{RI}])))", "p50 chip {{chip}} {{host}}/{{board}}"),
           (f"histogram_quantile(0.99, sum by (host, board, chip, le) (rate(npuserve:chip_idle_gap_seconds_bucket"
            f"{{{RAW}}}[{RI}])))", "p99 chip {{chip}} {{host}}/{{board}}"))),
    Panel("Preemptions", "ops",
          ((f"board:npuserve_preemptions:rate{{{SEL}}}", "{{host}}/{{board}}"),)),
    Panel("Speculative acceptance", "percentunit",
          ((f"board:npuserve_spec_acceptance:ratio{{{SEL}}}", "{{host}}/{{board}}"),),
          "accepted / proposed draft tokens (empty or NaN while nothing is drafted)"),
    Panel("Errors by code", "ops",
          ((f"sum by (host, board, reason) (rate(npuserve:request_failure_total{{{RAW}}}[{RI}]))",
            "failed {{reason}} {{host}}/{{board}}"),
           (f"sum by (host, board, reason) (rate(npuserve:requests_rejected_total{{{RAW}}}[{RI}]))",
            "rejected {{reason}} {{host}}/{{board}}"),
           (f'sum by (host, status) (rate(npuserve:http_requests_total{{{FRONT},status!~"2.."}}[{RI}]))',
            "HTTP {{status}} {{host}}"))),
    Panel("Per-tenant service", "short",
          ((f"sum by (host, board, tenant) (rate(npuserve:tenant_service_tokens_total{{{RAW}}}[{RI}]))",
            "{{tenant}} {{host}}/{{board}}"),)),
    Panel("Balancer backends", "short",
          ((f"npuserve:balancer_backends_up{{{BAL}}}", "up {{host}}"),
           (f"npuserve:balancer_backends_total{{{BAL}}}", "configured {{host}}"))),
    Panel("Targets and chips up", "short",
          (('up{job=~"npuserve-.*",host=~"$host"}', "{{role}} {{instance}}"),
           (f"board:npuserve_chips_up:sum{{{SEL}}}", "chips up {{host}}/{{board}}"))),
)


def _var(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2, "includeAll": True,
            "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1}


def layout(panels=PANELS, per_row: int = 3, height: int = 8) -> list[tuple[Panel, dict]]:
    """Each panel with its Grafana gridPos, `per_row` to a row."""
    w = WIDTH // per_row
    return [(p, {"h": height, "w": w, "x": (i % per_row) * w, "y": (i // per_row) * height})
            for i, p in enumerate(panels)]


def build() -> dict:
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels = []
    for i, (p, pos) in enumerate(layout(), start=1):
        panels.append({
            "id": i, "type": "timeseries", "title": p.title, "description": p.description, "gridPos": pos,
            "datasource": ds,
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + k), "expr": expr, "legendFormat": legend, "datasource": ds}
                        for k, (expr, legend) in enumerate(p.queries)],
        })
    return {
        "title": "npuserve", "uid": "npuserve-boards", "tags": ["npuserve"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            _var("host", "host", 'label_values(up{job=~"npuserve-.*"}, host)'),
            _var("board", "board", 'label_values(npuserve:chip_up{role="board",host=~"$host"}, board)'),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def queries(rate_interval: str = "1m", host: str = ".*", board: str = ".*") -> list[tuple[str, str]]:
    """(panel title, expr) of every panel query with the template variables filled in (what Grafana sends)."""
    return [(p.title, expr.replace("$__rate_interval", rate_interval).replace("$host", host).replace("$board", board))
            for p in PANELS for expr, _ in p.queries]
