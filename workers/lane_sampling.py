"""Sampling a job's lanes from the logits the backend returned: the lanes that want a token, and the
constrained lanes under their masks (structured output), the penalised ones through workers/penalties.py;
the sampler itself is workers/sampling.py."""

from __future__ import annotations

import numpy as np

from ipc.records import Job
from workers.constraints import ConstraintBook, ConstraintError, LaneMask
from workers.penalties import PenaltyBook, PenaltyError, sample_penalized
from workers.sampling import sample, token_logprob


def sample_lanes(job: Job, logits: np.ndarray, lanes: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
                 constraints: ConstraintBook | None = None, masks: dict[int, LaneMask] | None = None,
                 penalties: PenaltyBook | None = None) -> None:
    """Sample `lanes` of `logits` into `tokens`/`logprobs`, the constrained ones under their masks."""
    # Sampling is per lane and deterministic per (seed, position), so sampling
    # only the lanes that want a token gives the same tokens as sampling all
    # (and masking a constrained lane leaves its neighbours' rows alone).
    # Skip the fancy-index copy of [B, V] logits when every lane samples.
    if job.constrained and masks is None:
        if constraints is None:
            raise ConstraintError("constrained lanes in a job run without a constraint book")
        masks = constraints.masks(job, lanes, logits.shape[1])
    if job.penalties is not None:  # the penalised lanes apart (sampling is per lane: the same tokens)
        on = job.penalties.active[lanes] != 0
        if on.any():
            if penalties is None:
                raise PenaltyError("penalised lanes in a job run without a penalty book")
            sample_penalized(job, logits, lanes[on], tokens, logprobs, penalties, masks)
            lanes = lanes[~on]
            if not lanes.size:
                return
            if masks:
                rest = set(lanes.tolist())
                masks = {lane: m for lane, m in masks.items() if lane in rest}
    if masks:
        sample_masked(job, logits, lanes, tokens, logprobs, masks)
        return
    sel = slice(None) if lanes.size == job.batch else lanes
    t, lp = sample(
        logits[sel], job.temperature[sel], job.top_p[sel], job.top_k[sel], job.seed[sel],
        job.context_lens[sel], job.want_logprobs[sel],
    )
    tokens[lanes] = t
    logprobs[lanes] = lp


def sample_masked(job: Job, logits: np.ndarray, lanes: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
                  masks: dict[int, LaneMask]) -> None:
    """Sample with the constrained lanes masked: the same tokens as sampling full rows with the disallowed
    logits at -inf (a -inf logit has zero weight and keeps its place in every candidate order), cheaper.

    A lane with few allowed tokens samples over just those, plus one -inf (so that a top-k at least as
    large as the allowed set still takes sampling's top-k path, as on the full row); the others are copied
    with the denied ones at -inf and sampled together with the unconstrained lanes. Logprobs stay the
    model's own (raw logits)."""
    vocab = logits.shape[1]
    if any(m.vocab != vocab for m in masks.values()):
        raise ConstraintError(f"masks for a vocabulary other than the logits' {vocab}")
    lane_list = lanes.tolist()
    few = [lane for lane in lane_list if lane in masks and masks[lane].allow is not None]
    rest = np.array([lane for lane in lane_list if lane not in few], dtype=np.int64)
    for lane in few:
        ids = masks[lane].allow
        one = slice(lane, lane + 1)
        row = np.full((1, ids.shape[0] + 1), -np.inf, np.float32)
        row[0, :-1] = logits[lane, ids]
        k = int(job.top_k[lane])
        top_k = np.array([min(k, ids.shape[0]) if 0 < k < vocab else k], np.int32)
        t, _ = sample(row, job.temperature[one], job.top_p[one], top_k, job.seed[one], job.context_lens[one],
                      np.zeros(1, np.uint8))
        tokens[lane] = ids[int(t[0])]
    if rest.size:
        rows = logits[rest].astype(np.float32, copy=False)  # fancy indexing copies: writable, whatever the source
        for j, lane in enumerate(rest.tolist()):
            m = masks.get(lane)
            if m is not None:
                rows[j, m.deny] = -np.inf
        want = job.want_logprobs[rest] * np.array([lane not in masks for lane in rest.tolist()], np.uint8)
        t, lp = sample(rows, job.temperature[rest], job.top_p[rest], job.top_k[rest], job.seed[rest],
                       job.context_lens[rest], want)
        tokens[rest] = t
        logprobs[rest] = lp
    for lane in lane_list:
        if lane in masks:
            logprobs[lane] = token_logprob(logits[lane], int(tokens[lane])) if job.want_logprobs[lane] else 0.0
