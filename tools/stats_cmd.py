"""`npuserve stats`: print a daemon's statistics as a readable table (or `--json`).

First the dashboard of its metrics (tools/stats_view.py, the figures /metrics
exposes), then every other figure of the reply as `section.key value` rows.
"""

from __future__ import annotations

from engine.client import Client
from tools.query_cmd import run_query
from tools.stats_view import render


def flatten(d: object, prefix: str = "") -> list[tuple[str, object]]:
    """Nested dicts/lists -> (dotted.key, scalar) rows, in order."""
    rows: list[tuple[str, object]] = []
    if isinstance(d, dict):
        for k, v in d.items():
            rows += flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(d, list) and any(isinstance(x, (dict, list)) for x in d):
        for i, v in enumerate(d):
            rows += flatten(v, f"{prefix}[{i}]")
    else:
        rows.append((prefix, d))
    return rows


def format_stats(stats: dict) -> str:
    rows = flatten(stats)
    if not rows:
        return "(no statistics)"
    width = max(len(k) for k, _ in rows)
    out = []
    section = None
    for k, v in rows:
        top = k.split(".", 1)[0].split("[", 1)[0]
        if top != section:
            if section is not None:
                out.append("")
            section = top
        if isinstance(v, float):
            v = f"{v:.3f}".rstrip("0").rstrip(".") if v != int(v) else int(v)
        out.append(f"{k.ljust(width)}  {v}")
    return "\n".join(out)


def format_report(stats: dict) -> str:
    """The dashboard, then the details (the metric families themselves are only in --json)."""
    if "metrics" not in stats:  # not a board daemon (or an older one): the details are all there is
        return format_stats(stats)
    rest = {k: v for k, v in stats.items() if k != "metrics"}
    return render(stats) + "\n\ndetails\n\n" + format_stats(rest)


def main(argv: list[str]) -> int:
    return run_query(argv, name="stats", description="Show a daemon's statistics.", ask=Client.stats,
                     render=format_report, verdict=lambda _: 0)
