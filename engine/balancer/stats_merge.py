"""Summing the stats trees of several backends into one (the balancer's aggregated `stats`)."""

from __future__ import annotations

from typing import Any


def merge_stats(trees: list[Any]) -> Any:
    """Numbers are summed key by key, dicts merged recursively; other leaves keep the first value seen."""
    dicts = [t for t in trees if isinstance(t, dict)]
    if dicts and len(dicts) == len(trees):
        out: dict = {}
        for t in dicts:
            for k in t:
                if k not in out:
                    out[k] = merge_stats([d[k] for d in dicts if k in d])
        return out
    nums = [t for t in trees if type(t) in (int, float)]
    if nums and len(nums) == len(trees):
        return sum(nums)
    return trees[0] if trees else None
