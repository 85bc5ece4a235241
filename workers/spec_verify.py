"""Verification of speculative drafts: which draft tokens the target model accepts.

Every draft position is sampled exactly as a plain decode step would sample
it (`workers.sampling.sample`, the same (seed, position) uniform), and the
drafts are accepted while they equal those samples; the first sample that
differs (or the one after the last draft) is the lane's next token. So:

* greedy lanes accept the longest prefix matching the target's argmax, plus
  the target's next token;
* sampled lanes get exactly the target's distribution. The drafts here
  (n-gram lookup, a greedy draft model) are deterministic, i.e. a point-mass
  proposal q, for which the standard rejection rule (accept d with
  probability min(1, p(d)/q(d)) = p(d), else sample from (p - q)+) is the
  same law as "draw x ~ p, accept when x == d, else emit x". Drawing x with
  the per-position uniform makes the output a pure function of the request's
  seed and the position, whatever the draft proposed: token for token the
  output of the same request without speculation.

A constrained lane (structured output) samples each draft row under the mask
of the grammar advanced through the drafts before it, its last row included
(`masked`, `workers.masked_verify`): the same rule, under the same masks as
plain constrained decoding.
"""

from __future__ import annotations

import numpy as np

from ipc.records import Job
from workers.constraints import DraftMasks
from workers.masked_verify import verify_masked
from workers.sampling import sample


def draft_rows(job: Job) -> np.ndarray:
    """Packed token indices whose logits a verification job needs beside each lane's last token.

    For lane i with d = draft_lens[i] drafts, its tokens [t0, d1..dd] end at
    index e; rows e-d .. e-1 predict d1..dd (the last row, e, is the usual
    per-lane logits row and predicts the token after the drafts).
    """
    if not job.draft_lens.size:
        return np.zeros(0, np.int64)
    ends = job.query_start[1:].astype(np.int64)
    parts = [np.arange(e - d - 1, e - 1) for e, d in zip(ends, job.draft_lens.tolist()) if d > 0]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def verify_drafts(job: Job, rows_logits: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
                  masked: dict[int, DraftMasks] | None = None, last_logits: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Accept drafts lane by lane; rewrites tokens[lane] (and logprobs) to the token after the accepted run.

    `rows_logits` [len(draft_rows(job)), V]: the logits of `draft_rows(job)`,
    in that order; `tokens`/`logprobs` [B] hold each lane's sample from its
    last row (what follows a fully accepted run); `masked` lanes (constrained,
    with their draft rows' masks) are sampled here under those masks, their
    last row too, from `last_logits` [B, V]. Returns (accepted int32
    [B], the accepted drafts' logprobs float32 and tokens int32, packed lane
    after lane).
    """
    b = job.batch
    accepted = np.zeros(b, np.int32)
    acc_lps: list[float] = []
    acc_toks: list[int] = []
    dl = job.draft_lens.tolist()
    ends = job.query_start[1:].tolist()
    at = 0
    for lane in range(b):
        d = dl[lane]
        if d <= 0 or not job.lane_valid[lane]:
            continue
        rows = rows_logits[at:at + d]
        at += d
        if masked is not None and lane in masked:
            a, tokens[lane], logprobs[lane], lps, toks = verify_masked(job, lane, rows, last_logits[lane],
                                                                       masked[lane])
            accepted[lane] = a
            acc_lps.extend(lps.tolist())
            acc_toks.extend(toks.tolist())
            continue
        drafts = job.tokens[ends[lane] - d:ends[lane]]
        ctx = int(job.context_lens[lane])
        # the sampled token at row j sits at position ctx - d + j (the one after the token of row j)
        samp, lps = sample(rows, np.repeat(job.temperature[lane], d), np.repeat(job.top_p[lane], d),
                           np.repeat(job.top_k[lane], d), np.repeat(job.seed[lane], d),
                           np.arange(ctx - d, ctx), np.repeat(job.want_logprobs[lane], d))
        miss = np.flatnonzero(samp != drafts)
        a = int(miss[0]) if miss.size else d
        accepted[lane] = a
        acc_lps.extend(lps[:a].tolist())
        acc_toks.extend(drafts[:a].tolist())
        if a < d:  # the first rejected position's sample is the next token
            tokens[lane] = samp[a]
            logprobs[lane] = lps[a]
    return accepted, np.asarray(acc_lps, np.float32), np.asarray(acc_toks, np.int32)
