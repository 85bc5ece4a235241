"""How many drafts a lane carries: the k with the most expected tokens per unit of step cost.

A verification step of k drafts yields the accepted run plus one token:
with each draft accepted with probability a (given the ones before it),
E(k) = 1 + a + ... + a^k tokens, at a cost of `cost(k)` plain decode steps
(`StepCost`, measured). The lane drafts the k in 0..max_k that maximises
E(k) / cost(k); k = 0 (plain decoding, 1 token per step) wins when no k pays.
The acceptance a is the lane's own, learnt from its verifications (each
accepted draft a success, the first rejected one a failure) as a running
estimate; while k = 0 wins the lane learns nothing, so it probes one draft
again after a back-off that doubles each time (up to `MAX_BACKOFF` steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MAX_BACKOFF = 64
DECAY = 0.85  # weight kept by the older verifications per new one
PRIOR = (4.0, 1.0)  # (successes, failures) before any verification: a = 0.8, drafting is tried


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verification step of k drafts yields when each is accepted with probability a."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def best_k(a: float, max_k: int, cost: Callable[[int], float]) -> int:
    """The k in 0..max_k with the most expected tokens per step cost (the smaller k on a tie)."""
    best, best_rate = 0, 1.0
    for k in range(1, max_k + 1):
        rate = expected_tokens(a, k) / cost(k)
        if rate > best_rate * (1.0 + 1e-9):
            best, best_rate = k, rate
    return best


@dataclass
class CostK:
    max_k: int
    successes: float = PRIOR[0]
    failures: float = PRIOR[1]
    skip: int = 0  # steps left without drafting
    backoff: int = 2

    @property
    def acceptance(self) -> float:
        return self.successes / (self.successes + self.failures)

    def next_k(self, cost: Callable[[int], float]) -> int:
        """The draft length for this step (0: decode plainly). Call once per step."""
        if self.max_k <= 0:
            return 0
        if self.skip > 0:
            self.skip -= 1
            return 0 if self.skip > 0 else 1  # the back-off's last step probes one draft
        k = best_k(self.acceptance, self.max_k, cost)
        if k == 0:
            self.skip = self.backoff
            self.backoff = min(MAX_BACKOFF, self.backoff * 2)
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        """The verification of `drafted` tokens accepted `accepted` of them (a run, then one rejection)."""
        if drafted <= 0:
            return
        self.successes = DECAY * self.successes + accepted
        self.failures = DECAY * self.failures + (1 if accepted < drafted else 0)
        if accepted:
            self.backoff = 2
