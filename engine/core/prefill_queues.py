"""Job opportunities shared by decode and three prefill size classes.

Classes are served by smooth weighted round robin (decode:short:medium:long =
8:4:2:1 by default) among the classes that have work, so a long prompt keeps a
minimum share of the chip under constant decode and decode is never blocked
behind a queue of prefills.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable


class WorkClass(enum.Enum):
    DECODE = "decode"
    SHORT = "short"
    MEDIUM = "medium"
    LONG = "long"

    __hash__ = object.__hash__  # members are singletons; Enum's name hash is slow on the hot path


PREFILL_CLASSES = (WorkClass.SHORT, WorkClass.MEDIUM, WorkClass.LONG)


def prefill_class(n_tokens: int, short_max: int, medium_max: int) -> WorkClass:
    if n_tokens <= short_max:
        return WorkClass.SHORT
    if n_tokens <= medium_max:
        return WorkClass.MEDIUM
    return WorkClass.LONG


class SmoothWeightedRoundRobin:
    """nginx-style smooth WRR: over any window the picks follow the weights, interleaved."""

    def __init__(self, weights: dict[WorkClass, int]) -> None:
        assert all(w > 0 for w in weights.values())
        self.weights = dict(weights)
        self._current = {c: 0 for c in weights}
        self.picks = {c: 0 for c in weights}

    def pick(self, candidates: Iterable[WorkClass]) -> WorkClass | None:
        """Once per job submitted: a plain loop over the (at most four) classes, no temporaries."""
        wanted = candidates if isinstance(candidates, (list, tuple, set, frozenset)) else list(candidates)
        current, weights = self._current, self.weights
        total = 0
        best: WorkClass | None = None
        for c, w in weights.items():  # configuration order: ties go to the earlier class, as max() did
            if c in wanted:
                cur = current[c] + w
                current[c] = cur
                total += w
                if best is None or cur > current[best]:
                    best = c
        if best is None:
            return None
        current[best] -= total
        self.picks[best] += 1
        return best


class PrefillQueues:
    """Per-chip FIFO queues of request ids waiting for their next prefill job."""

    def __init__(self, short_max: int, medium_max: int) -> None:
        self.short_max = short_max
        self.medium_max = medium_max
        self._q: dict[WorkClass, deque[int]] = {c: deque() for c in PREFILL_CLASSES}
        self._cls: dict[int, WorkClass] = {}

    def __len__(self) -> int:
        return len(self._cls)

    def __contains__(self, rid: int) -> bool:
        return rid in self._cls

    def push(self, rid: int, total_prefill_tokens: int, front: bool = False) -> None:
        """Queue by the request's whole prefill size, so all its chunks stay in one class."""
        assert rid not in self._cls
        c = prefill_class(total_prefill_tokens, self.short_max, self.medium_max)
        (self._q[c].appendleft if front else self._q[c].append)(rid)
        self._cls[rid] = c

    def remove(self, rid: int) -> None:
        c = self._cls.pop(rid, None)
        if c is not None:
            self._q[c].remove(rid)

    def nonempty(self) -> list[WorkClass]:
        return [c for c in PREFILL_CLASSES if self._q[c]]

    def pop(self, c: WorkClass) -> int:
        rid = self._q[c].popleft()
        del self._cls[rid]
        return rid

    def members(self, c: WorkClass) -> deque[int]:
        """The request ids queued in class `c`, oldest first (read only: for statistics)."""
        return self._q[c]

    def depths(self) -> dict[str, int]:
        return {c.value: len(self._q[c]) for c in PREFILL_CLASSES}

    def ids(self) -> list[int]:
        return list(self._cls)
