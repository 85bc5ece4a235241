"""Routing policies: which routable backend gets a request.

`choose` is pure: it takes the candidates (already filtered by pool, model,
health and exclusions) and returns one. Policies:

* `round-robin`: smooth weighted round-robin (nginx's): even interleaving by weight.
* `least-load`: fewest requests in flight per unit of weight.
* `prefix`: lowest cost = prompt tokens still to prefill there (prompt blocks
  minus those the prefix index says it holds) + `decode_cost_tokens` per
  request in flight (per unit of weight); ties to the lower load. An imbalance
  guard switches to least-load while the loads are too uneven (max - min >
  `imbalance_abs` and max > `imbalance_rel` x (min + 1)), so a hot prefix cannot
  pile everything onto one board.

Backends whose load figure is stale (no heartbeat for `stale_after_s`) count as
saturated: they are chosen only when every candidate is stale.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from engine.balancer.backend_state import Backend
from engine.balancer.prefix_index import PrefixIndex


class Policy(enum.Enum):
    PREFIX = "prefix"
    LEAST_LOAD = "least-load"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class RoutingPolicy:
    policy: Policy = Policy.PREFIX
    block_size: int = 16
    decode_cost_tokens: int = 64
    imbalance_abs: int = 8
    imbalance_rel: float = 2.0
    pd_min_prompt_tokens: int = 0  # disaggregation: shorter prompts go whole to a decode board (pd_routing)


@dataclass(frozen=True)
class Choice:
    backend: Backend
    matched_blocks: int
    policy_used: Policy


def _scaled_load(b: Backend) -> float:
    return b.load() / b.spec.weight


def imbalanced(cands: Sequence[Backend], rp: RoutingPolicy) -> bool:
    loads = [_scaled_load(b) for b in cands]
    lo, hi = min(loads), max(loads)
    return hi - lo > rp.imbalance_abs and hi > rp.imbalance_rel * (lo + 1)


def _round_robin(cands: Sequence[Backend]) -> Backend:
    total = sum(b.spec.weight for b in cands)
    for b in cands:
        b.rr_current += b.spec.weight
    best = max(cands, key=lambda b: (b.rr_current, b.name))
    best.rr_current -= total
    return best


def _least_load(cands: Sequence[Backend]) -> Backend:
    return min(cands, key=lambda b: (_scaled_load(b), -b.spec.weight, b.picks, b.name))


def choose(cands: Sequence[Backend], hashes: Sequence[int], prompt_len: int, rp: RoutingPolicy,
           index: PrefixIndex) -> Choice:
    assert cands, "choose needs at least one candidate"
    pol = rp.policy
    if pol is Policy.ROUND_ROBIN:
        b = _round_robin(cands)
        return Choice(b, index.matched(b.name, hashes), pol)
    if pol is Policy.PREFIX and len(cands) > 1 and imbalanced(cands, rp):
        pol = Policy.LEAST_LOAD
    if pol is Policy.LEAST_LOAD:
        b = _least_load(cands)
        if len(cands) > 1:
            b.picks += 1
        return Choice(b, index.matched(b.name, hashes), pol)
    best = None
    for b in cands:
        m = index.matched(b.name, hashes)
        cost = (prompt_len - m * rp.block_size) + rp.decode_cost_tokens * _scaled_load(b)
        key = (cost, _scaled_load(b), b.picks, b.name)
        if best is None or key < best[0]:
            best = (key, b, m)
    assert best is not None
    best[1].picks += 1
    return Choice(best[1], best[2], pol)
