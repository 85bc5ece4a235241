"""A PNG of the dashboard: its panels in their grid places, each drawn from a Prometheus's answers to its queries.

Grafana is not installable here, so docs/observability.md shows the layout
this way: the same PANELS, the same queries (template variables filled in as
Grafana would with "All"), the data a real Prometheus returned over a time
range (`/api/v1/query_range`).
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request

from tools.monitoring.dashboard import PANELS, WIDTH, layout


def query_range(prom_url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    q = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
    with urllib.request.urlopen(f"{prom_url}/api/v1/query_range?{q}", timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"query_range {expr!r}: {body}")
    return body["data"]["result"]


def _legend(fmt: str, labels: dict) -> str:
    out = fmt
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def render(prom_url: str, out_path: str, start: float, end: float, step: float = 1.0,
           rate_interval: str = "1m", per_row: int = 4) -> dict[str, int]:
    """Draw every panel into out_path; returns panel title -> series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    placed = layout(PANELS, per_row=per_row)
    rows = max(pos["y"] // pos["h"] for _, pos in placed) + 1
    fig = plt.figure(figsize=(4.2 * per_row, 2.7 * rows))
    fig.suptitle("npuserve dashboard (grafana-dashboard.json) drawn from a live Prometheus", fontsize=12)
    drawn: dict[str, int] = {}
    cols = WIDTH // placed[0][1]["w"]
    for i, (panel, pos) in enumerate(placed):
        ax = fig.add_subplot(rows, cols, i + 1)
        n = 0
        for expr, legend in panel.queries:
            filled = expr.replace("$__rate_interval", rate_interval).replace("$host", ".*").replace("$board", ".*")
            for s in query_range(prom_url, filled, start, end, step):
                pts = [(float(t) - start, float(v)) for t, v in s["values"] if not math.isnan(float(v))]
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], linewidth=1,
                        label=_legend(legend, s["metric"])[:40])
                n += 1
        drawn[panel.title] = n
        ax.set_title(panel.title, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("s", fontsize=7)
        if panel.unit not in ("short", ""):
            ax.set_ylabel(panel.unit, fontsize=7)
        if n:
            ax.legend(fontsize=5, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(out_path, dpi=80)
    plt.close(fig)
    return drawn
