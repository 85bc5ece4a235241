"""Verifying the drafts of a constrained lane (structured output): every draft row sampled under its own mask.

Plain constrained decoding samples position p under the mask of the grammar
after the tokens before p. A verification job holds the lane's input token
and its drafts, so the mask of draft row j is the grammar's after drafts
1..j (`ConstraintBook.draft_masks`, computed beside the backend call). Each
row is sampled exactly as the plain step at its position would sample it
(`workers.lane_sampling.sample_masked`: the same masked sampler, the same
(seed, position) uniform, logprobs the model's own), and the drafts are
accepted while they equal those samples. A draft the grammar forbids can
never equal its row's sample, so it is rejected there and the row's masked
sample is the lane's next token; the rows after it are not needed (their
masks would need the forbidden draft fed). So the output is token for token
that of the same request without speculation, and the matcher is then set
back to the accepted run (`ConstraintBook.settle`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ipc.records import Job
from workers.constraints import ConstraintError, DraftMasks
from workers.lane_sampling import sample_masked


@dataclass
class _Rows:
    """The sampling parameters of one lane's rows, in the per-lane arrays `sample_masked` reads from a job."""

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    seed: np.ndarray
    context_lens: np.ndarray  # the position each row's sample takes
    want_logprobs: np.ndarray


def verify_masked(job: Job, lane: int, rows: np.ndarray, last_row: np.ndarray, dm: DraftMasks
                  ) -> tuple[int, int, float, np.ndarray, np.ndarray]:
    """(accepted drafts, the next token, its logprob, the accepted drafts' logprobs and tokens) of `lane`.

    `rows` [d, V]: the logits of the lane's draft rows; `last_row` [V]: of its
    last row (the token after all d drafts).
    """
    d = int(job.draft_lens[lane])
    drafts = np.asarray(job.lane_tokens(lane)[-d:], np.int64)
    n = len(dm.rows) - 1  # drafts that passed the grammar, in order
    if not 0 <= n <= d:
        raise ValueError(f"lane {lane}: {len(dm.rows)} draft masks for {d} drafts")
    use = rows[:n + 1] if n < d else np.concatenate([rows, np.asarray(last_row)[None, :]])
    k = use.shape[0]
    ctx = int(job.context_lens[lane])
    params = _Rows(np.repeat(job.temperature[lane], k), np.repeat(job.top_p[lane], k),
                   np.repeat(job.top_k[lane], k), np.repeat(job.seed[lane], k),
                   np.arange(ctx - d, ctx - d + k), np.repeat(job.want_logprobs[lane], k))
    toks = np.full(k, -1, np.int32)
    lps = np.zeros(k, np.float32)
    sample_masked(params, use, np.arange(k), toks, lps, dict(enumerate(dm.rows)))
    m = min(k, d)
    miss = np.flatnonzero(toks[:m] != drafts[:m])
    a = int(miss[0]) if miss.size else m
    if a >= k:  # with n < d drafts allowed, row n's masked sample cannot equal the forbidden draft n
        raise ConstraintError(f"lane {lane}: draft {a} accepted past the grammar's masks")
    return a, int(toks[a]), float(lps[a]), lps[:a], drafts[:a].astype(np.int32)
