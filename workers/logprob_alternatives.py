"""Log-probabilities beyond the sampled token's: the top-k alternatives of a sampled row, and the prompt's.

Both are the log-softmax of the *raw* logits (temperature 1, before any filter or
mask), as `workers.sampling` reports the sampled token's: the model's own
distribution, whatever the request's sampling parameters, so the sampled token's
logprob equals its entry among the alternatives when it is one of them.
Alternatives are ordered by logprob descending, ties to the lower id.

Only lanes whose `want_logprobs` byte asks (`ipc.logprob_wants`) pay for this;
a job where none asks never calls it.
"""

from __future__ import annotations

import numpy as np

from ipc.logprob_wants import PROMPT, top_count, top_counts
from ipc.records import Job, JobKind


def _lse(z: np.ndarray) -> float:
    """log-sum-exp of one float32 row, computed as `workers.sampling` does for the sampled token."""
    m = float(z.max())
    return m + float(np.log(np.exp(z - np.float32(m)).sum(dtype=np.float64)))


def row_top(z: np.ndarray, k: int, lse: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely ids of one row of raw logits and their logprobs (value descending, ties to lower id)."""
    z = np.asarray(z, dtype=np.float32)
    if lse is None:
        lse = _lse(z)
    k = min(k, z.shape[0])
    if k <= 0:
        return np.zeros(0, np.int32), np.zeros(0, np.float32)
    cand = np.argpartition(-z, k - 1)[:k] if k < z.shape[0] else np.arange(z.shape[0])
    kth = z[cand].min()
    cand = np.flatnonzero(z >= kth)  # every id tied at the k-th value, so the lower ids win the ties below
    order = np.lexsort((cand, -z[cand]))[:k]
    ids = cand[order]
    return ids.astype(np.int32), (z[ids].astype(np.float64) - lse).astype(np.float32)


def lane_alternatives(job: Job, logits: np.ndarray, lanes: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(top_ids [B, K], top_logprobs [B, K]) of the sampled `lanes` that ask for alternatives; None: none asks."""
    ks = np.zeros(job.batch, np.int64)
    ks[lanes] = top_counts(job.want_logprobs[lanes])
    k_max = int(ks.max()) if ks.size else 0
    if k_max == 0:
        return None
    ids = np.full((job.batch, k_max), -1, np.int32)
    lps = np.zeros((job.batch, k_max), np.float32)
    for lane in np.flatnonzero(ks).tolist():
        k = int(ks[lane])
        ids[lane, :k], lps[lane, :k] = row_top(logits[lane], k)
    return ids, lps


def prompt_lanes(job: Job) -> list[int]:
    """The valid lanes of a prefill job that ask for their input tokens' logprobs."""
    if job.kind != JobKind.PREFILL or not job.want_logprobs.size:
        return []
    ask = ((job.want_logprobs & PROMPT) != 0) & (job.lane_valid != 0)
    return np.flatnonzero(ask).tolist()


def prompt_rows(job: Job) -> np.ndarray:
    """Indices into job.tokens of the rows whose logits prompt logprobs need: every row of each PROMPT lane
    but its last (row j predicts the lane's token j+1; the last row's is the sampled token). In lane order:
    the order of `StepOutput.prompt_logits`."""
    qs = job.query_start
    parts = [np.arange(qs[lane], qs[lane + 1] - 1) for lane in prompt_lanes(job)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def prompt_alternatives(job: Job, prompt_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                                      np.ndarray | None]:
    """(logprobs [R], lane starts [B+1], top_ids [R, K] or None, top_logprobs [R, K] or None) of the PROMPT
    lanes' input tokens after each lane's first, from the logits of `prompt_rows(job)`."""
    rows = prompt_rows(job)
    if prompt_logits is None or prompt_logits.shape[0] != rows.shape[0]:
        raise RuntimeError("the backend did not return the logits of the prompt rows")
    lanes = prompt_lanes(job)
    k_max = max((top_count(job.want_logprobs[lane]) for lane in lanes), default=0)
    n = rows.shape[0]
    lps = np.zeros(n, np.float32)
    ids = np.full((n, k_max), -1, np.int32) if k_max else None
    tlps = np.zeros((n, k_max), np.float32) if k_max else None
    qs = job.query_start
    counts = np.zeros(job.batch + 1, np.int64)
    at = 0
    for lane in lanes:
        counts[lane + 1] = int(qs[lane + 1] - qs[lane]) - 1
        k = top_count(job.want_logprobs[lane])
        nxt = job.tokens[qs[lane] + 1:qs[lane + 1]]
        for j in range(nxt.shape[0]):
            z = np.asarray(prompt_logits[at], dtype=np.float32)
            lse = _lse(z)
            lps[at] = float(z[int(nxt[j])]) - lse
            if k:
                ids[at, :k], tlps[at, :k] = row_top(z, k, lse)
            at += 1
    return lps, np.cumsum(counts).astype(np.int32), ids, tlps
