"""The KV tiers' metric families (host pool, disk tier, transfers), from the scheduler's `kv_tiers` stats.

Names follow the rest of `metrics.py` (`npuserve:` prefix, `_total` on
counters); one row per tier (`tier` = host | disk), misses by cause, and
the transfer times as a histogram per kind (export | import).
"""

from __future__ import annotations

from typing import Protocol

TIERS = ("host", "disk")
MISS_CAUSES = ("absent", "pending", "not_worth", "refused")


class Builder(Protocol):
    def add(self, kind: str, name: str, doc: str, labels: tuple[str, ...], samples) -> None: ...


def tier_families(b: Builder, kt: dict) -> None:
    c = kt["counters"]
    tiers = [t for t in TIERS if t in kt]
    b.add("gauge", "kv_tier_blocks", "KV blocks held by each tier below the device (ready to promote).",
          ("tier",), [((t,), kt[t]["blocks"]) for t in tiers])
    b.add("gauge", "kv_tier_bytes", "Bytes of KV held by each tier below the device.", ("tier",),
          [((t,), kt[t]["bytes"]) for t in tiers])
    b.add("gauge", "kv_tier_capacity_blocks", "Blocks each tier can hold.", ("tier",),
          [((t,), kt[t]["capacity_blocks"]) for t in tiers])
    b.add("counter", "kv_tier_hits", "Prompt blocks found in a tier and promoted to a chip.", ("tier",),
          [((t,), c.get(f"hit_{t}_blocks", 0)) for t in tiers])
    b.add("counter", "kv_tier_evictions", "Blocks a tier let go of for room (LRU).", ("tier",),
          [((t,), kt[t]["counters"].get("evicted", 0)) for t in tiers])
    b.add("counter", "kv_tier_promotions", "Blocks imported to a chip (KV_IMPORT jobs, or imports in prefill jobs, "
          "that succeeded).", (),
          [((), c.get("promoted_blocks", 0))])
    b.add("counter", "kv_tier_demotions", "Blocks exported from a chip, by why: write_through (new prefix "
          "blocks) or demoted (evicted by the device).", ("why",),
          [((w,), c.get(f"export_{w}_blocks", 0)) for w in ("write_through", "demoted")])
    b.add("counter", "kv_tier_bytes_moved", "KV bytes moved by transfer jobs (both ways).", (),
          [((), c.get("bytes_moved", 0))])
    b.add("counter", "kv_tier_misses", "Lookups past the device hit that found no promotable block, by cause "
          "(absent, pending = still being exported, not_worth = recompute is cheaper, refused = a corrupt, "
          "truncated or missing record).", ("cause",), [((m,), c.get(f"miss_{m}", 0)) for m in MISS_CAUSES])
    b.add("histogram", "kv_tier_transfer_seconds", "Transfer jobs from submission to result, by kind.",
          ("kind",), [((k,), (tuple(zip(v["buckets"], v["counts"])), v["counts"][-1], v["sum"]))
                      for k, v in kt["transfer_seconds"].items()])
