"""`npuserve stats`: print a daemon's statistics as a readable table (or `--json`)."""

from __future__ import annotations

import argparse
import sys

import orjson

from engine.client import Client, default_endpoint
from engine.errors import ClientError


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
    p = argparse.ArgumentParser(prog="npuserve stats", description="Show a daemon's statistics.")
    p.add_argument("--endpoint", default=None)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        with Client(a.endpoint or default_endpoint(), timeout=a.timeout) as c:
            s = c.stats()
    except ClientError as e:
        print(f"npuserve stats: {e}", file=sys.stderr)
        return 2
    if a.json:
        sys.stdout.buffer.write(orjson.dumps(s) + b"\n")
    else:
        print(format_stats(s))
    return 0
