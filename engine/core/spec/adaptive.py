"""How many draft tokens to propose for one lane: adaptive k from the measured acceptance.

Verification of k drafts costs a pass over k+1 positions; when the drafts
keep failing (free-form text) that is extra work for one token, so k follows
the acceptance: it grows by one after a fully accepted step, falls to just
past the accepted run after a rejection, and when the running acceptance rate
drops below `min_rate` the lane stops drafting for a back-off that doubles
each time (up to `MAX_BACKOFF` steps) and then probes again.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BACKOFF = 64
EWMA = 0.3  # weight of the newest step in the running acceptance rate


@dataclass
class AdaptiveK:
    max_k: int
    min_rate: float = 0.25
    k: int = 0
    rate: float = 1.0  # running acceptance rate (accepted / drafted)
    skip: int = 0  # steps left without drafting
    backoff: int = 2

    def __post_init__(self) -> None:
        if self.k == 0:
            self.k = self.max_k

    def next_k(self) -> int:
        """The draft length for this step (0: decode plainly). Call once per step."""
        if self.max_k <= 0:
            return 0
        if self.skip > 0:
            self.skip -= 1
            return 0
        return self.k

    def observe(self, drafted: int, accepted: int) -> None:
        """The verification of `drafted` tokens accepted `accepted` of them."""
        if drafted <= 0:
            return
        self.rate = (1 - EWMA) * self.rate + EWMA * (accepted / drafted)
        self.k = min(self.max_k, self.k + 1) if accepted == drafted else max(1, accepted + 1)
        if self.rate < self.min_rate:
            self.skip = self.backoff
            self.backoff = min(MAX_BACKOFF, self.backoff * 2)
            self.rate = self.min_rate  # the probe after the back-off starts from the threshold
        elif accepted:
            self.backoff = 2
