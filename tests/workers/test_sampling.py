"""Sampling: greedy, filters, determinism per (seed, position), distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.sampling import _INITIAL_MARGIN, lane_uniforms, sample


def _call(logits, temperature=1.0, top_p=1.0, top_k=0, seed=0, positions=None, want=None):
    z = np.atleast_2d(np.asarray(logits, dtype=np.float32))
    b = z.shape[0]
    pos = np.arange(b) if positions is None else np.asarray(positions)
    return sample(z, np.full(b, temperature, np.float32), np.full(b, top_p, np.float32),
                  np.full(b, top_k, np.int32), np.broadcast_to(np.uint64(seed), (b,)).copy(), pos, want)


def _target(z: np.ndarray, temperature: float, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """The filtered, renormalised distribution, by full sort in float64 (independent of the sampler)."""
    s = z.astype(np.float64) / temperature
    order = np.argsort(-s, kind="stable")
    keep = np.zeros(len(z), dtype=bool)
    k = top_k if 0 < top_k < len(z) else len(z)
    top = order[:k]
    p = np.exp(s[top] - s[top].max())
    p /= p.sum()
    n = int(np.searchsorted(np.cumsum(p), top_p) + 1) if top_p < 1 else k
    keep[top[: min(n, k)]] = True
    out = np.where(keep, np.exp(s - s.max()), 0.0)
    return out / out.sum()


def _chi2_z(counts: np.ndarray, probs: np.ndarray) -> float:
    """Wilson-Hilferty normal score of Pearson's chi-square statistic (large = misfit)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the support was drawn"
    e = probs[support] * counts.sum()
    stat = float(((counts[support] - e) ** 2 / e).sum())
    df = int(support.sum()) - 1
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


N_DRAWS = 20_000
LOGITS = np.array([2.0, 1.5, 1.2, 1.0, 0.7, 0.3, 0.0, -0.4, -0.8, -1.5, -2.0, -3.0], dtype=np.float32)


def _counts(logits, n=N_DRAWS, **kw):
    z = np.tile(logits, (n, 1))
    toks, _ = _call(z, positions=np.arange(n), seed=1234, **kw)
    return np.bincount(toks, minlength=len(logits))


def test_greedy_is_argmax_whatever_the_filters():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((32, 500)).astype(np.float32)
    for top_p, top_k in ((1.0, 0), (0.3, 0), (1.0, 7), (0.5, 3)):
        toks, _ = _call(z, temperature=0.0, top_p=top_p, top_k=top_k)
        assert np.array_equal(toks, z.argmax(axis=1))


def test_greedy_ties_go_to_the_lowest_id():
    z = np.zeros((1, 10), np.float32)
    z[0, [3, 7]] = 5.0
    assert _call(z, temperature=0.0)[0][0] == 3


def test_tiny_temperature_behaves_like_greedy_without_nan():
    rng = np.random.default_rng(1)
    z = rng.standard_normal((16, 100)).astype(np.float32)
    toks, lp = _call(z, temperature=1e-30, top_p=0.9)
    assert np.array_equal(toks, z.argmax(axis=1))
    assert np.all(np.isfinite(lp))


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 12),
    lane=st.data(),
    params=st.tuples(st.sampled_from([0.0, 0.5, 1.0, 1.7]), st.sampled_from([1.0, 0.9, 0.3]),
                     st.sampled_from([0, 1, 5, 40])),
    seed=st.integers(0, 2**64 - 1),
    position=st.integers(0, 100_000),
)
def test_a_lane_samples_the_same_token_in_any_batch_and_lane_index(batch, lane, params, seed, position):
    temperature, top_p, top_k = params
    rng = np.random.default_rng(position)
    row = (rng.standard_normal(300) * 2).astype(np.float32)
    alone_tok, alone_lp = sample(row[None], np.array([temperature]), np.array([top_p]), np.array([top_k]),
                                 np.array([seed], np.uint64), np.array([position]))
    idx = lane.draw(st.integers(0, batch - 1))
    z = (rng.standard_normal((batch, 300)) * 3).astype(np.float32)
    z[idx] = row
    temps = rng.choice([0.0, 0.7, 1.3], size=batch).astype(np.float32)
    tps = rng.choice([1.0, 0.8], size=batch).astype(np.float32)
    tks = rng.choice([0, 3, 50], size=batch).astype(np.int32)
    seeds = rng.integers(0, 2**63, size=batch).astype(np.uint64)
    poss = rng.integers(0, 10_000, size=batch)
    temps[idx], tps[idx], tks[idx], seeds[idx], poss[idx] = temperature, top_p, top_k, seed, position
    toks, lps = sample(z, temps, tps, tks, seeds, poss)
    assert toks[idx] == alone_tok[0]
    assert lps[idx] == alone_lp[0]


def test_draws_depend_on_seed_and_position():
    z = np.zeros((400, 50), np.float32)  # uniform: every token equally likely
    by_position = _call(z, seed=7, positions=np.arange(400))[0]
    by_seed = sample(z, np.ones(400), np.ones(400), np.zeros(400, np.int32),
                     np.arange(400, dtype=np.uint64), np.full(400, 9))[0]
    assert len(set(by_position.tolist())) > 40
    assert len(set(by_seed.tolist())) > 40
    again = _call(z, seed=7, positions=np.arange(400))[0]
    assert np.array_equal(by_position, again)


def test_lane_uniforms_are_uniform_and_in_range():
    u = lane_uniforms(np.full(50_000, 3, np.uint64), np.arange(50_000))
    assert u.min() >= 0.0 and u.max() < 1.0
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert _chi2_z(counts, np.full(20, 1 / 20)) < 4.0


def test_top_k_never_leaves_the_k_best():
    rng = np.random.default_rng(3)
    z = rng.standard_normal(1000).astype(np.float32)
    best = set(np.argsort(-z)[:5].tolist())
    toks, _ = _call(np.tile(z, (3000, 1)), temperature=2.0, top_k=5, positions=np.arange(3000))
    assert set(toks.tolist()) == best  # inside the k best, and every one of them reachable


def test_top_p_never_leaves_the_nucleus():
    rng = np.random.default_rng(4)
    for scale, top_p in ((1.0, 0.5), (6.0, 0.9), (0.2, 0.95)):
        z = (rng.standard_normal(2000) * scale).astype(np.float32)
        nucleus = set(np.flatnonzero(_target(z, 1.0, top_p=top_p)).tolist())
        toks, _ = _call(np.tile(z, (3000, 1)), temperature=1.0, top_p=top_p, positions=np.arange(3000))
        assert set(toks.tolist()) <= nucleus
        assert len(nucleus) < 2000


def test_top_p_handles_minus_inf_logits():
    z = np.full(64, -np.inf, np.float32)
    z[[5, 9]] = [1.0, 0.0]
    toks, lp = _call(np.tile(z, (200, 1)), top_p=0.99, positions=np.arange(200))
    assert set(toks.tolist()) == {5, 9}
    assert np.all(np.isfinite(lp))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_distribution(temperature):
    counts = _counts(LOGITS, temperature=temperature)
    assert _chi2_z(counts, _target(LOGITS, temperature)) < 4.0
    # The check is sensitive: the same counts do not fit the untempered distribution.
    if temperature != 1.0:
        assert _chi2_z(counts, _target(LOGITS, 1.0)) > 10.0


@pytest.mark.parametrize("top_p,top_k", [(1.0, 4), (0.7, 0), (0.8, 6), (0.95, 0)])
def test_filtered_distributions(top_p, top_k):
    counts = _counts(LOGITS, temperature=0.9, top_p=top_p, top_k=top_k)
    target = _target(LOGITS, 0.9, top_p=top_p, top_k=top_k)
    assert _chi2_z(counts, target) < 4.0


def test_top_p_distribution_when_the_candidate_set_must_widen():
    # One strong token and a long tail more than _INITIAL_MARGIN below it: the first candidate
    # set (the strong token alone) holds less than top_p, so the sampler must widen it.
    z = np.concatenate([[0.0], np.linspace(-9.0, -9.5, 1499)]).astype(np.float32)
    p = np.exp(z.astype(np.float64))
    p /= p.sum()
    assert p[z >= -_INITIAL_MARGIN].sum() < 0.9
    counts = _counts(z, n=10_000, temperature=1.0, top_p=0.9)
    target = _target(z, 1.0, top_p=0.9)
    assert 100 < np.count_nonzero(target) < 1000
    bins = np.array([0, 1, *range(51, 1500, 50)])

    def coarse(a):
        return np.add.reduceat(a, bins)

    assert counts[target == 0].sum() == 0
    assert _chi2_z(coarse(counts)[coarse(target) > 0], coarse(target)[coarse(target) > 0]) < 4.0


def test_logprobs_are_raw_log_softmax_of_the_chosen_token():
    rng = np.random.default_rng(5)
    z = (rng.standard_normal((8, 700)) * 4).astype(np.float32)
    want = np.array([1, 0, 1, 1, 0, 1, 1, 1], np.uint8)
    toks, lp = _call(z, temperature=0.7, top_k=20, want=want)
    z64 = z.astype(np.float64)
    lse = z64.max(1) + np.log(np.exp(z64 - z64.max(1, keepdims=True)).sum(1))
    expected = z64[np.arange(8), toks] - lse
    np.testing.assert_allclose(lp[want == 1], expected[want == 1], atol=1e-4)
    assert np.all(lp[want == 0] == 0.0)


def test_large_vocab_top_p_and_top_k():
    rng = np.random.default_rng(6)
    z = (rng.standard_normal((4, 152_000)) * 2).astype(np.float32)
    z[:, 77] += 20.0  # a confident model: token 77 holds > 99% of the mass
    toks, _ = _call(z, temperature=1.0, top_p=0.5)
    assert np.all(toks == 77)
    toks, _ = _call(z, temperature=1.0, top_k=3)
    for r in range(4):
        assert toks[r] in set(np.argsort(-z[r])[:3].tolist())


def test_rejects_bad_inputs():
    z = np.zeros((2, 5), np.float32)
    with pytest.raises(ValueError):
        sample(z, np.ones(3), np.ones(2), np.zeros(2), np.zeros(2, np.uint64), np.zeros(2))
    with pytest.raises(ValueError):
        sample(z, np.array([np.nan, 1.0]), np.ones(2), np.zeros(2), np.zeros(2, np.uint64), np.zeros(2))
    bad = z.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError):
        sample(bad, np.ones(2), np.ones(2), np.zeros(2), np.zeros(2, np.uint64), np.zeros(2))


def test_an_all_greedy_batch_without_logprobs_is_the_per_lane_argmax_and_still_refuses_nan():
    rng = np.random.default_rng(3)
    z = rng.integers(-3, 3, (64, 300)).astype(np.float32)  # many ties: the lowest id must win in every row
    n = len(z)
    args = (np.zeros(n), np.ones(n), np.zeros(n), np.arange(n, dtype=np.uint64), np.arange(n))
    toks, lps = sample(z, *args, want_logprobs=np.zeros(n, np.uint8))
    assert toks.dtype == np.int32 and not lps.any()
    assert toks.tolist() == [int(np.flatnonzero(row == row.max())[0]) for row in z]
    frozen = z.copy()
    frozen.flags.writeable = False  # as the llamacpp backend hands over llama.cpp's own buffer
    assert sample(frozen, *args, want_logprobs=np.zeros(n, np.uint8))[0].tolist() == toks.tolist()
    all_minus_inf = np.full((2, 5), -np.inf, np.float32)
    with pytest.raises(ValueError, match="row 0"):
        sample(all_minus_inf, np.zeros(2), np.ones(2), np.zeros(2), np.arange(2, dtype=np.uint64), np.arange(2),
               want_logprobs=np.zeros(2, np.uint8))
    for bad_value in (np.nan, np.inf):
        bad = z.copy()
        bad[5, 17] = bad_value
        with pytest.raises(ValueError, match="row 5"):
            sample(bad, *args, want_logprobs=np.zeros(n, np.uint8))
