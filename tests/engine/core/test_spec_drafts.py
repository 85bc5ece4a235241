"""n-gram drafts and adaptive k (pure, no scheduler)."""

from __future__ import annotations

import random

from hypothesis import given, strategies as st

from engine.core.spec.adaptive import AdaptiveK
from engine.core.spec.ngram_draft import NgramDrafter


def brute(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for at in range(len(tokens) - 1, n - 1, -1):  # latest earlier occurrence with a continuation
            if at < len(tokens) and tokens[at - n:at] == suffix:
                return tokens[at:at + k]
    return []


def test_copies_the_continuation_of_the_latest_occurrence() -> None:
    d = NgramDrafter(1, 3)
    toks = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert d.propose(toks, 3) == [8, 9, 1]
    assert d.propose(toks + [8], 2) == [9, 1]
    assert NgramDrafter(2, 3).propose([1, 2, 3, 4], 4) == []
    assert d.propose(toks, 0) == [] and d.propose([1], 3) == []


@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 5), st.integers(1, 2), st.integers(0, 2))
def test_incremental_index_equals_a_scan(tokens, k, min_n, extra) -> None:
    max_n = min_n + extra
    d = NgramDrafter(min_n, max_n)
    for end in range(1, len(tokens) + 1):  # proposals as the sequence grows, one token at a time
        assert d.propose(tokens[:end], k) == brute(tokens[:end], k, min_n, max_n)


def test_adaptive_k_grows_shrinks_and_backs_off() -> None:
    a = AdaptiveK(max_k=4)
    assert a.next_k() == 4
    a.observe(4, 1)
    assert a.next_k() == 2
    a.observe(2, 2)
    assert a.next_k() == 3
    for _ in range(6):
        a.observe(a.next_k() or 1, 0)
    skipped = 0
    while a.next_k() == 0:
        skipped += 1
    assert skipped >= 2  # backed off, then probes again
    assert AdaptiveK(max_k=0).next_k() == 0


def test_adaptive_k_settles_on_random_drafts() -> None:
    """At a 5 % chance per draft token the lane drafts on few steps (free-form text costs little)."""
    rng = random.Random(1)
    a = AdaptiveK(max_k=4)
    drafting = 0
    for _ in range(400):
        k = a.next_k()
        if k:
            drafting += 1
            acc = 0
            while acc < k and rng.random() < 0.05:
                acc += 1
            a.observe(k, acc)
    assert drafting < 60
