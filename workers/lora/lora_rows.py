"""The per-lane low-rank product: lanes of different adapters in one job (Punica's / S-LoRA's segmented gather).

The base matrices run once over every row of the job; each adapter's
(x @ A) @ B runs over the rows of the lanes that use it and is added to those
rows only. Rows of base-model lanes get nothing added, so a lane's output
does not depend on which adapters its neighbours run under.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from workers.lora.adapter_package import LoraWeights


class LoraRows:
    """Which device slot each packed row runs under (-1: base model), grouped by slot."""

    def __init__(self, slots: Sequence[LoraWeights | None], row_slot: np.ndarray) -> None:
        self.slots = slots
        self.row_slot = row_slot
        self.groups = [(int(s), np.flatnonzero(row_slot == s)) for s in np.unique(row_slot) if s >= 0]

    @classmethod
    def for_lanes(cls, slots: Sequence[LoraWeights | None], lane_slot: np.ndarray,
                  counts: np.ndarray) -> "LoraRows | None":
        """Rows of lanes packed back to back (`counts` rows each); None when every lane runs the base model."""
        if not len(lane_slot) or int(lane_slot.max()) < 0:
            return None
        return cls(slots, np.repeat(lane_slot, counts))

    def take(self, rows: np.ndarray) -> "LoraRows":
        """The same lanes after the rows were narrowed to `rows` (the last layer keeps each lane's last row)."""
        return LoraRows(self.slots, self.row_slot[rows])

    def add(self, out: np.ndarray, x: np.ndarray, layer: int, target: str, col: int = 0) -> None:
        """out[rows, col:col + out_dim] += (x[rows] @ A) @ B for each adapter adapting `target` of `layer`."""
        for s, idx in self.groups:
            pair = self.slots[s].pairs.get((layer, target))
            if pair is not None:
                a, b = pair
                out[idx, col:col + b.shape[1]] += (x[idx] @ a) @ b
