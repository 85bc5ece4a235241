"""`npuserve stats`: print a daemon's statistics as a readable table (or `--json`)."""

from __future__ import annotations

from engine.client import Client
from tools.query_cmd import run_query


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


def main(argv: list[str]) -> int:
    return run_query(argv, name="stats", description="Show a daemon's statistics.", ask=Client.stats,
                     render=format_stats, verdict=lambda _: 0)
