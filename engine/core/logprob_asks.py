"""What a request asks of log-probabilities beyond the sampled token's, as the scheduler carries it.

* Alternatives (`top_logprobs` = k): each sampled token's k most likely tokens. Its
  lanes ask the worker with the `want_logprobs` byte (`ipc.logprob_wants`); the
  result's `top_ids` / `top_logprobs` rows ride with the token through the stop
  checker (a held-back token keeps its alternatives) as a `TokenLogprob`, which
  `Output.accept` splits again into the `logprobs` and `top_logprobs` of an
  `EmitTokens`. Such lanes decode one step per job and do not speculate (the
  multi-step and verification paths return no alternatives).
* Prompt log-probabilities (`prompt_logprobs` = k): for each prompt token after the
  first, its log-probability given the ones before it and the k most likely tokens
  there. The prompt is computed whole in one job from position 0 (no prefix-cache
  hit, no chunking): row j of that job predicts token j+1, so every row the answer
  needs is in the job. The answer is emitted once, before the first token, even
  if the request is later recomputed.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.core.actions import EmitTokens
from ipc.logprob_wants import want_code


class TokenLogprob(NamedTuple):
    """A sampled token's logprob and its alternatives [(id, logprob), ...], as one stop-checker entry."""

    logprob: float
    top: list


def sampling_want(logprobs: bool, top_logprobs: int) -> int:
    """The `want_logprobs` byte of a request's decode lanes."""
    return want_code(logprobs, top_logprobs)


def prompt_lane_want(r, start: int, sample: bool) -> int:
    """The `want_logprobs` byte of request record r's lane from `start`: its decode byte, plus the prompt's
    logprobs on the job that computes the whole prompt (from 0, sampling) while they are still owed."""
    p = r.params
    if p.prompt_logprobs is None or start != 0 or not sample or r.prompt_logprobs_sent:
        return r.sampling[4]
    return want_code(True, max(p.top_logprobs, p.prompt_logprobs), prompt=True)


def whole_prompt(r) -> bool:
    """Whether r's prompt must be computed in one job from position 0 (no chunks, no cached prefix)."""
    return r.params.prompt_logprobs is not None and not r.prompt_logprobs_sent


def lane_payloads(lps: list[float], top_ids, top_lps, lane: int, k: int) -> list:
    """`lps` with entry `lane` made a TokenLogprob carrying its k alternatives (a copy: lps is the job's)."""
    ids = top_ids[lane, :k].tolist()
    vals = top_lps[lane, :k].tolist()
    out = list(lps)
    out[lane] = TokenLogprob(lps[lane] if lane < len(lps) else 0.0, [[i, v] for i, v in zip(ids, vals)])
    return out


def split(emit_lps: list) -> tuple[list[float], list[list]]:
    """The emitted tokens' logprobs and alternatives, from stop-checker entries (TokenLogprob or plain)."""
    lps, tops = [], []
    for e in emit_lps:
        if type(e) is TokenLogprob:
            lps.append(e.logprob)
            tops.append(e.top)
        else:
            lps.append(e)
            tops.append([])
    return lps, tops


def prompt_answer(prompt: list[int], result, lane: int, k: int) -> dict | None:
    """The wire `prompt_logprobs` object of a prompt computed whole in `lane` of a job's result: one entry per
    prompt token, the first null; None when the result does not hold them for the lane."""
    lps, starts = result.prompt_logprobs, result.prompt_start
    n = len(prompt)
    if lps is None or starts is None or starts.shape[0] <= lane + 1:
        return None
    a, b = int(starts[lane]), int(starts[lane + 1])
    if b - a < n - 1 or b > lps.shape[0]:
        return None
    vals = lps[a:a + n - 1].tolist()
    tops: list = [[]]
    ids = result.prompt_top_ids
    if k and ids is not None and ids.shape[0] >= a + n - 1:
        ids = ids[a:a + n - 1, :k].tolist()
        tl = result.prompt_top_logprobs[a:a + n - 1, :k].tolist()
        tops += [[[i, v] for i, v in zip(x, y)] for x, y in zip(ids, tl)]
    else:
        tops += [[] for _ in range(n - 1)]
    return {"tokens": list(prompt), "logprobs": [None] + vals, "top_logprobs": tops}


def lane_asks(r, result, lane: int, lps: list, out: list) -> tuple[list, bool]:
    """Request record r's sampled `lane` of a job result, when r asks for more than plain logprobs: its
    prompt's logprobs emitted (once: False when the result lacks them, and the request must fail), and the
    job's `lps` with r's entry carrying its alternatives."""
    p = r.params
    if p.prompt_logprobs is not None and not r.prompt_logprobs_sent:
        answer = prompt_answer(p.prompt, result, lane, p.prompt_logprobs)
        if answer is None:
            return lps, False
        r.prompt_logprobs_sent = True
        out.append(EmitTokens(r.request_id, [], None, None, None, answer))
    if p.top_logprobs and result.top_ids is not None and result.top_ids.shape[0] > lane:
        lps = lane_payloads(lps, result.top_ids, result.top_logprobs, lane, p.top_logprobs)
    return lps, True
