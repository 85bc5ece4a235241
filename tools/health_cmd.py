"""`npuserve health`: ask a daemon or balancer for its health (exit 0 when ok, 1 otherwise)."""

from __future__ import annotations

from engine.client import Client
from tools.query_cmd import run_query


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
    return run_query(argv, name="health", description="Show a daemon's health.", ask=Client.health,
                     render=format_health, verdict=lambda h: 0 if h.get("ok") else 1)
