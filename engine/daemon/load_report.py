"""The load figures a daemon's `health` reply carries for balancers (their heartbeat).

Queue depth, running sequences and the share of KV blocks in use, summed
over chips: what a balancer needs to tell a busy board from an idle one,
without the cost of the full `stats` tree on every heartbeat.
"""

from __future__ import annotations


def load_report(scheduler_stats: dict) -> dict:
    total = used = 0
    for ch in scheduler_stats.get("chips", {}).values():
        blocks = ch.get("kv", {}).get("blocks", {})
        total += blocks.get("total", 0)
        used += blocks.get("used", 0)
    return {"waiting": scheduler_stats.get("waiting_requests", 0),
            "running": scheduler_stats.get("active_sequences", 0),
            "kv_used": round(used / total, 4) if total else None}
