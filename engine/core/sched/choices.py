"""A `generate` with `n` > 1: its choices as requests of their own that share the prompt's computation.

Choice 0 (the leader) is submitted at once; choices 1..n-1 are held until the
leader's prompt is computed (it decodes, or it ended), then submitted: their
prompt's full KV blocks are then the leader's, found in the prefix cache
(shared, reference-counted), and each recomputes only the tokens after the
last full block: where the backend copies blocks, by copying the leader's
(engine/core/sched/choice_fork.py), else by computing them again. Each choice is then an ordinary request: admission, tenant
fairness and KV reservation count it, and it ends with its own terminal event.

Seeds: choice k of a request with seed s samples with seed
(s + k * 0x9E3779B97F4A7C15) mod 2^64 (as engine/http/choices.py), so choice 0
is what n = 1 gives and each choice is what n = 1 with its seed gives.
"""

from __future__ import annotations

import dataclasses

from engine.core.requests import GenerateParams, RequestState

MAX_CHOICES = 16
_GOLDEN = 0x9E3779B97F4A7C15
_PROMPT_DONE = frozenset({RequestState.DECODE_READY, RequestState.DECODE_RUNNING, RequestState.FINISHING})


def choice_seed(seed: int, k: int) -> int:
    return (seed + k * _GOLDEN) & 0xFFFFFFFFFFFFFFFF


def choice_params(params: GenerateParams, n: int) -> list[GenerateParams]:
    """The n choices' parameters: the same request, each with its own seed stream."""
    return [params if k == 0 else dataclasses.replace(params, seed=choice_seed(params.seed, k)) for k in range(n)]


class HeldChoices:
    """Choices 1..n-1 of each request whose leader has not computed its prompt yet."""

    def __init__(self) -> None:
        self._held: dict[int, list[tuple[int, GenerateParams]]] = {}  # leader rid -> (rid, params) held

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, leader: int, siblings: list[tuple[int, GenerateParams]]) -> None:
        if siblings:
            self._held[leader] = siblings

    def drop(self, rid: int) -> GenerateParams | None:
        """Forget held choice `rid` (cancelled before it was submitted); its params, None when not held."""
        for leader, sibs in self._held.items():
            for i, (r, p) in enumerate(sibs):
                if r == rid:
                    del sibs[i]
                    if not sibs:
                        del self._held[leader]
                    return p
        return None

    def due(self, requests: dict, everything: bool = False) -> list[tuple[int, int, GenerateParams]]:
        """(leader, rid, params) of the held choices whose leader computed its prompt or ended (all of them
        with `everything`)."""
        out = []
        for leader in list(self._held):
            r = requests.get(leader)
            if everything or r is None or r.terminal or r.state in _PROMPT_DONE:
                out += [(leader, rid, p) for rid, p in self._held.pop(leader)]
        return out
