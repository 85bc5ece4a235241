"""Per-chip dispatch: which chip a newly admitted sequence goes to.

Prefer the chip already holding the longest cached prefix of the prompt
(its KV need not be recomputed), then the least loaded chip, then the one
with the most free KV.  Chips out of service or without room never win.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ChipCandidate:
    chip: int
    in_service: bool
    available_blocks: int
    blocks_needed: int  # for this prompt, ignoring any cache hit
    cached_tokens: int  # longest cached prefix of the prompt on this chip
    load: int  # sequences bound to the chip + jobs in flight


def choose_chip(candidates: Sequence[ChipCandidate]) -> int | None:
    fit = [c for c in candidates if c.in_service and c.available_blocks >= c.blocks_needed]
    if not fit:
        return None
    best = min(fit, key=lambda c: (-c.cached_tokens, c.load, -c.available_blocks, c.chip))
    return best.chip
