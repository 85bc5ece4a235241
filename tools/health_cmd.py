"""`npuserve health`: ask a daemon or balancer for its health (exit 0 when ok, 1 otherwise)."""

from __future__ import annotations

import argparse
import sys

import orjson

from engine.client import Client, default_endpoint
from engine.errors import ClientError


def format_health(h: dict) -> str:
    lines = [
        f"ok:         {h.get('ok')}",
        f"accepting:  {h.get('accepting')}",
        f"loop lag:   {h.get('loop_lag_ms')} ms",
    ]
    m = h.get("model") or {}
    if m:
        lines.append(f"model:      {m.get('alias')} ({m.get('backend')}, vocab {m.get('vocab_size')}, "
                     f"max_seq {m.get('max_seq')}, profiles {m.get('profiles')})")
    if "active_requests" in h:
        lines.append(f"active:     {h['active_requests']} requests")
    chips = h.get("chips") or []
    if chips:
        lines.append("chips:")
        lines.append(f"  {'chip':>4}  {'state':<10}  {'pid':>7}  {'restarts/10min':>14}  last failure")
        for c in chips:
            lines.append(f"  {c.get('chip', '?'):>4}  {str(c.get('state')):<10}  {str(c.get('pid') or '-'):>7}  "
                         f"{c.get('restarts_10min', 0):>14}  {c.get('last_failure') or ''}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="npuserve health", description="Show a daemon's health.")
    p.add_argument("--endpoint", default=None)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        with Client(a.endpoint or default_endpoint(), timeout=a.timeout) as c:
            h = c.health()
    except ClientError as e:
        print(f"npuserve health: {e}", file=sys.stderr)
        return 2
    if a.json:
        sys.stdout.buffer.write(orjson.dumps(h) + b"\n")
    else:
        print(format_health(h))
    return 0 if h.get("ok") else 1
