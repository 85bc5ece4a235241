"""Per-lane token sampling: greedy, temperature, top-k, top-p.

Determinism: the only randomness is one uniform number per lane derived by
hashing (seed, position). Each lane's row is processed on its own (a loop
over lanes, never a batch-wide reduction whose rounding could depend on the
other rows), and the draw is an inverse-CDF lookup over a canonical
candidate order. So a lane gets the same token whatever batch it sits in,
whichever lane index it has, on any chip, and after a retry.

Cost for large vocabularies (e.g. 152k): no full sort. top-k uses
argpartition; top-p without top-k takes only the tokens within a logit
margin of the maximum as candidates and widens the margin until the
candidates hold at least top_p of the mass (the nucleus is a prefix of the
descending order, so it then lies inside them); plain temperature sampling
is a cumulative sum in token-id order.

The same tokens off the host: a device that samples (the C ABI's device-side
multi-step decode; workers/native/reference_chip.c ports this file) must draw
what this code draws. So every choice here is a function of values a C port
computes bit for bit: the scaled logits in float32, every weight exp(s) in
float64 (numpy's float32 exp is SIMD code that differs from libm's in the
last bit of many values, enough to move a draw about once in 10^6 rows; a
last-bit difference of a float64 moves one about once in 10^14), a top-k
set that breaks ties at the k-th value to the lower ids (argpartition alone
picks any of them), and one candidate order (value descending, then id).

Logprobs are the log-softmax of the *raw* logits (temperature 1, before any
top-k/top-p filtering) at the chosen token: the model's own probability,
comparable across requests whatever their sampling parameters, and finite
for greedy lanes.
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_POSITION_SALT = np.uint64(0xD6E8FEB86659FD93)
_INITIAL_MARGIN = 8.0  # logits (after temperature) within this of the max start as top-p candidates
_MAX_MARGIN = 128.0


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GAMMA
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def lane_uniforms(seed: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One float64 in [0, 1) per lane, a pure function of (seed, position)."""
    s = np.atleast_1d(np.asarray(seed)).astype(np.uint64)
    p = np.atleast_1d(np.asarray(positions)).astype(np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix64(s ^ _splitmix64(p * _POSITION_SALT))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _draw(weights: np.ndarray, u: float) -> int:
    """Index i with probability weights[i]/sum, by inverse CDF (zero-weight entries never chosen)."""
    cdf = np.cumsum(weights, dtype=np.float64)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(i, len(weights) - 1)


def _desc_order(values: np.ndarray) -> np.ndarray:
    """Order of candidates (given in ascending token id) by value descending, ties to the lower id."""
    return np.argsort(-values, kind="stable")


def _top_k_ids(scaled: np.ndarray, k: int) -> np.ndarray:
    """Ids (ascending) of the k largest of `scaled` (max 0), ties at the k-th value to the lower ids.

    argpartition over a margin-filtered subset finds the k-th value; which of the tokens tied at it get in
    is then decided by id, not by argpartition's internals (a device sampler must pick the same ones).
    """
    margin = _INITIAL_MARGIN
    while margin <= _MAX_MARGIN:
        cand = np.flatnonzero(scaled >= -margin)  # every token above the threshold, so a superset of the top k
        if len(cand) >= k:
            break
        margin *= 2.0
    else:
        cand = np.arange(len(scaled))
    vals = scaled[cand]
    kth = vals[np.argpartition(vals, len(cand) - k)[len(cand) - k]]
    above = cand[vals > kth]
    return np.sort(np.concatenate([above, cand[vals == kth][: k - len(above)]]))


def _sample_row(z: np.ndarray, temperature: float, top_p: float, top_k: int, u: float) -> int:
    v = z.shape[0]
    if temperature <= 0.0 or top_k == 1:
        return int(np.argmax(z))
    # Shift first so a tiny temperature sends non-max logits to -inf, never to NaN.
    scaled = (z - z.max()) / np.float32(max(temperature, 1e-30))
    m = 0.0
    k = top_k if 0 < top_k < v else v
    if k < v:
        ids = _top_k_ids(scaled, k)
        vals = scaled[ids].astype(np.float64)
        order = _desc_order(vals)
        ids, w = ids[order], np.exp(vals[order] - m)
        if top_p < 1.0:
            cum = np.cumsum(w) / w.sum()
            w = w[: min(int(np.searchsorted(cum, top_p, side="left")) + 1, k)]
        return int(ids[_draw(w, u)])
    if top_p < 1.0:
        total = float(np.exp(scaled, dtype=np.float64).sum())  # m = 0
        margin = _INITIAL_MARGIN
        while True:
            # Past _MAX_MARGIN the excluded tokens carry < V * e^-128 of the mass: take everything.
            ids = np.flatnonzero(scaled >= m - margin) if margin <= _MAX_MARGIN else np.arange(v)
            vals = scaled[ids].astype(np.float64)
            w_all = np.exp(vals - m)
            if w_all.sum() >= top_p * total or len(ids) == v:
                break
            margin *= 2.0
        order = _desc_order(vals)
        ids, w = ids[order], w_all[order]
        cum = np.cumsum(w) / total
        w = w[: min(int(np.searchsorted(cum, top_p, side="left")) + 1, len(w))]
        return int(ids[_draw(w, u)])
    return _draw(np.exp(scaled, dtype=np.float64), u)  # m = 0


def token_logprob(z: np.ndarray, token: int) -> float:
    """log-softmax of one row of raw logits at `token` (what `sample` reports as a lane's logprob)."""
    return _logprob(np.asarray(z, dtype=np.float32), token)


def _logprob(z: np.ndarray, token: int) -> float:
    m = float(z.max())
    lse = m + float(np.log(np.exp(z - np.float32(m)).sum(dtype=np.float64)))
    return float(z[token]) - lse


def sample(
    logits: np.ndarray,
    temperature: np.ndarray,
    top_p: np.ndarray,
    top_k: np.ndarray,
    seed: np.ndarray,
    positions: np.ndarray,
    want_logprobs: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Sample one token per row of logits [B, V].

    temperature <= 0 means greedy (argmax, lowest id on ties); top_k <= 0 or
    >= V and top_p >= 1 switch those filters off; top-k applies first, then
    top-p on the renormalised top-k distribution. `positions[b]` is the
    position of the token being sampled (the lane's context length). Returns
    (tokens int32 [B], logprobs float32 [B]); logprobs are 0 where
    want_logprobs is 0 (all are computed when it is None).
    """
    z = np.asarray(logits)
    if z.ndim != 2:
        raise ValueError("logits must be [B, V]")
    b = z.shape[0]
    if z.dtype != np.float32:
        z = z.astype(np.float32)
    temperature = np.asarray(temperature, dtype=np.float64).reshape(-1)
    top_p = np.asarray(top_p, dtype=np.float64).reshape(-1)
    top_k = np.asarray(top_k, dtype=np.int64).reshape(-1)
    for name, a in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if a.shape != (b,):
            raise ValueError(f"{name} must have one entry per row")
    if not (np.all(np.isfinite(temperature)) and np.all(np.isfinite(top_p))):
        raise ValueError("temperature and top_p must be finite")
    u = lane_uniforms(seed, positions)
    if u.shape != (b,):
        raise ValueError("seed and positions must have one entry per row")
    want = np.ones(b, dtype=bool) if want_logprobs is None else np.asarray(want_logprobs).astype(bool).reshape(-1)
    if b and not want.any() and bool(np.all((temperature <= 0.0) | (top_k == 1))):
        # Every lane greedy (a decode step of greedy requests): the row maxima, then the first index holding
        # each (argmax: exact, lowest id on ties, the same as the loop below); a NaN or inf maximum takes the
        # loop (its error). Not z.argmax: numpy copies a read-only array (the runtime's own logits buffer,
        # 33 MB for 32 Gemma rows) before an argmax; max and == read it in place: 3 ms instead of 10.
        top = z.max(axis=1)
        if np.isfinite(top).all():
            return (z == top[:, None]).argmax(axis=1).astype(np.int32), np.zeros(b, dtype=np.float32)
    tokens = np.empty(b, dtype=np.int32)
    logprobs = np.zeros(b, dtype=np.float32)
    for i in range(b):
        row = z[i]
        if not np.isfinite(row.max()):
            raise ValueError(f"row {i}: logits hold NaN or +inf")
        tokens[i] = _sample_row(row, float(temperature[i]), float(top_p[i]), int(top_k[i]), float(u[i]))
        if want[i]:
            logprobs[i] = _logprob(row, int(tokens[i]))
    return tokens, logprobs
