"""Lanes of a job and their adapters: at most `slots` distinct adapters per job, and the job's adapter field.

A chip holds `slots` adapters in device memory (the backend's slots, at most
`lora.max_loaded_per_chip`); a job whose lanes name more could not run, so
the lanes past the limit wait for a later job (their order is kept: the
lanes first in the plan go first). Base-model lanes never count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NO_ADAPTER = -1


def within_slots(lanes: Sequence, slots: int, seen: set[int] | None = None) -> tuple[list, list]:
    """(kept, deferred) lanes (request records) so the kept ones name at most `slots` adapters.

    `seen`: adapters already in the job (updated in place)."""
    seen = set() if seen is None else seen
    kept, deferred = [], []
    for r in lanes:
        a = r.params.adapter
        if a < 0 or a in seen:
            kept.append(r)
        elif len(seen) < slots:
            seen.add(a)
            kept.append(r)
        else:
            deferred.append(r)
    return kept, deferred


def adapter_field(lanes: Sequence, batch: int) -> np.ndarray | None:
    """Job.adapter for lanes (request records, in lane order) of a `batch`-lane job; None when all are base."""
    ids = [r.params.adapter for r in lanes]
    if max(ids, default=NO_ADAPTER) < 0:
        return None
    return np.array(ids + [NO_ADAPTER] * (batch - len(ids)), np.int32)
