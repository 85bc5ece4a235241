"""Batch profile choice.

A model declares the compiled batch sizes it has (B1/B4/B8/B16...).  The
ready count picks a target: the largest profile B with ready >= ceil(ratio*B)
(ratio 0.75 gives the thresholds 12/6/3 for B16/B8/B4), otherwise the
smallest profile; then every ready sequence that fits fills its lanes.  Low
traffic gets a small batch at once rather than waiting to fill a large one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.config_schema import ConfigError


def resolve_profiles(configured: Sequence[int] | None, declared: Sequence[int]) -> tuple[int, ...]:
    declared_set = {int(b) for b in declared}
    if not declared_set or min(declared_set) < 1:
        raise ConfigError(f"the model declares no usable batch profile: {tuple(declared)}")
    if configured is None:
        return tuple(sorted(declared_set))
    chosen = tuple(sorted({int(b) for b in configured}))
    if not chosen:
        raise ConfigError("batch.profiles is empty")
    missing = [b for b in chosen if b not in declared_set]
    if missing:
        raise ConfigError(
            f"batch profile(s) {missing} are not declared by the model (it has {sorted(declared_set)})")
    return chosen


def select_profile(ready: int, profiles: Sequence[int], fill_ratio: float = 0.75) -> int:
    """Compiled batch B for a decode job when `ready` sequences wait (ready >= 1)."""
    assert ready >= 1 and profiles
    for b in sorted(profiles, reverse=True):
        if ready >= math.ceil(fill_ratio * b):
            return b
    return min(profiles)


def lanes_for(ready: int, profiles: Sequence[int], fill_ratio: float = 0.75) -> tuple[int, int]:
    """(B, number of active lanes) for `ready` sequences; (0, 0) when none is ready."""
    if ready <= 0:
        return 0, 0
    b = select_profile(ready, profiles, fill_ratio)
    return b, min(ready, b)
