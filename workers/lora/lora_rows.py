"""The per-lane low-rank product: lanes of different adapters in one job (Punica's / S-LoRA's kernels).

The base matrices run once over every row of the job; each adapter's
(x @ A) @ B is added to the rows of the lanes that use it only, so a lane's
output does not depend on which adapters its neighbours run under. Two ways,
the same sums:

* segmented (SGMV): per adapter, one product over its rows. Few large
  segments: prefill.
* gathered (BGMV): every adapter row at once, each row's A and B taken from
  the device slots stacked (`LoraStack`, rebuilt when an adapter is loaded or
  unloaded; ranks padded with zeros, targets an adapter leaves alone are
  zeros too): two batched products per matrix whatever the number of
  adapters. Many small segments: decode, where per-adapter calls would cost
  more than the arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from workers.lora.adapter_package import LoraWeights

GATHER_MAX_ROWS = 64  # gathered when a job's adapter rows are at most this many and span several adapters


class LoraStack:
    """Per (layer, target): A [slots, in, r_max] and B [slots, r_max, out] of the adapters in the device slots."""

    def __init__(self, slots: Sequence[LoraWeights | None]) -> None:
        loaded = [w for w in slots if w is not None]
        self.stacks: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
        if not loaded:
            return
        r_max = max(w.rank for w in loaded)
        for key in sorted({k for w in loaded for k in w.pairs}):
            a0, b0 = next(w.pairs[key] for w in loaded if key in w.pairs)
            a_st = np.zeros((len(slots), a0.shape[0], r_max), np.float32)
            b_st = np.zeros((len(slots), r_max, b0.shape[1]), np.float32)
            for s, w in enumerate(slots):
                if w is not None and key in w.pairs:
                    a, b = w.pairs[key]
                    a_st[s, :, :a.shape[1]] = a
                    b_st[s, :b.shape[0], :] = b
            self.stacks[key] = (a_st, b_st)


class LoraRows:
    """Which device slot each packed row runs under (-1: base model), grouped by slot."""

    def __init__(self, slots: Sequence[LoraWeights | None], row_slot: np.ndarray,
                 stack: LoraStack | None = None) -> None:
        self.slots = slots
        self.row_slot = row_slot
        self.stack = stack
        self.groups = [(int(s), np.flatnonzero(row_slot == s)) for s in np.unique(row_slot) if s >= 0]
        self.rows = np.flatnonzero(row_slot >= 0)
        self.gather = stack is not None and len(self.groups) > 1 and len(self.rows) <= GATHER_MAX_ROWS

    @classmethod
    def for_lanes(cls, slots: Sequence[LoraWeights | None], lane_slot: np.ndarray, counts: np.ndarray,
                  stack: LoraStack | None = None) -> "LoraRows | None":
        """Rows of lanes packed back to back (`counts` rows each); None when every lane runs the base model."""
        if not len(lane_slot) or int(lane_slot.max()) < 0:
            return None
        return cls(slots, np.repeat(lane_slot, counts), stack)

    def take(self, rows: np.ndarray) -> "LoraRows":
        """The same lanes after the rows were narrowed to `rows` (the last layer keeps each lane's last row)."""
        return LoraRows(self.slots, self.row_slot[rows], self.stack)

    def add(self, out: np.ndarray, x: np.ndarray, layer: int, target: str, col: int = 0) -> None:
        """out[rows, col:col + out_dim] += (x[rows] @ A) @ B for each adapter adapting `target` of `layer`."""
        if self.gather:
            st = self.stack.stacks.get((layer, target))
            if st is not None:
                idx = self.rows
                s = self.row_slot[idx]
                a_st, b_st = st
                xa = np.matmul(x[idx][:, None, :], a_st[s])  # [n, 1, r]
                out[idx, col:col + b_st.shape[2]] += np.matmul(xa, b_st[s])[:, 0, :]
            return
        for s, idx in self.groups:
            pair = self.slots[s].pairs.get((layer, target))
            if pair is not None:
                a, b = pair
                out[idx, col:col + b.shape[1]] += (x[idx] @ a) @ b
