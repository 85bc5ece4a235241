"""Sampling penalties in the worker: logit bias, min_tokens, repetition/frequency/presence penalties, min_p.

vLLM's semantics, in vLLM's order, on a float32 copy of the lane's logits row:

1. min_tokens: while fewer than min_tokens output tokens came before this
   one, EOS and the stop ids are -inf.
2. logit_bias: bias[id] is added to logit[id].
3. repetition_penalty r, over every token of the prompt or the output: a
   positive logit is divided by r, a non-positive one multiplied by r.
4. frequency_penalty f and presence_penalty p, over the output tokens:
   logit -= f * count, then logit -= p (where count > 0).
5. (greedy picks the argmax here; sampling divides by the temperature)
6. min_p m: tokens whose probability (after temperature) is below m times
   the most likely token's are -inf, i.e. those with
   (logit - max) / temperature < ln(m).

The row then goes through the plain sampler (`workers.sampling.sample`:
top-k, top-p, the seeded draw), so a lane draws the same token in any batch
and on any chip. Logprobs stay the model's own (the raw logits).

The counts live here between jobs, one state per request key
(`ipc.lane_penalties`), rebuilt from the tokens so far by the lane that ends
a (re)prefill and advanced by one token per decode lane, exactly once.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ipc.records import Job
from workers.constraints import LaneMask
from workers.sampling import sample, token_logprob

_MAX_STATES = 1024  # requests whose counts a worker keeps, least recently used first out (a chip's live lanes: fewer)


class PenaltyError(RuntimeError):
    """A penalised lane the worker cannot serve (no state for its request): fails the job, never the worker."""


@dataclass
class PenaltyState:
    prompt_ids: np.ndarray  # distinct prompt token ids, ascending
    counts: dict[int, int] = field(default_factory=dict)  # output token -> occurrences
    consumed: int = 0  # output tokens counted
    bias_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    bias_values: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    stop_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    def count(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1
        self.consumed += 1


class PenaltyBook:
    """The token counts of the penalised requests this worker serves, by request key."""

    def __init__(self) -> None:
        self._states: OrderedDict[int, PenaltyState] = OrderedDict()
        self.rebuilds = 0

    def __len__(self) -> int:
        return len(self._states)

    def state(self, job: Job, lane: int) -> PenaltyState:
        """Lane `lane`'s state, rebuilt (a rebuild lane) or advanced by its input token (a decode lane)."""
        pen = job.penalties
        key, done = int(pen.key[lane]), int(pen.done[lane])
        if pen.rebuild[lane]:
            hist = pen.lane_history(lane)
            if hist.shape[0] < done:
                raise PenaltyError(f"lane {lane}: {hist.shape[0]} history tokens for {done} output tokens")
            for name, ids in (("history", hist), ("logit bias", pen.lane_bias(lane)[0]),
                              ("stop", pen.lane_stop_ids(lane))):
                if ids.size and ids.min() < 0:
                    raise PenaltyError(f"lane {lane}: a negative token id in its {name}")
            cut = hist.shape[0] - done
            st = PenaltyState(np.unique(hist[:cut]).astype(np.int32))
            for t in hist[cut:].tolist():
                st.count(t)
            ids, vals = pen.lane_bias(lane)
            st.bias_ids, st.bias_values = np.array(ids, np.int32), np.array(vals, np.float32)
            st.stop_ids = np.array(pen.lane_stop_ids(lane), np.int32)
            self._states[key] = st
            self._states.move_to_end(key)
            self.rebuilds += 1
            while len(self._states) > _MAX_STATES:
                self._states.popitem(last=False)
            return st
        st = self._states.get(key)
        if st is None:
            raise PenaltyError(f"lane {lane}: no penalty state for request key {key} (its prefill ran elsewhere)")
        self._states.move_to_end(key)
        if st.consumed == done - 1:
            toks = job.lane_tokens(lane)
            if toks.shape[0] != 1 or toks[0] < 0:
                raise PenaltyError(f"lane {lane}: a penalised decode lane needs its input token")
            st.count(int(toks[0]))
        elif st.consumed != done:
            raise PenaltyError(f"lane {lane}: {st.consumed} output tokens counted, the job says {done}")
        return st


def penalize_row(z: np.ndarray, st: PenaltyState, done: int, min_tokens: int, presence: float, frequency: float,
                 repetition: float) -> None:
    """Steps 1-4 of the module docstring, in place on one float32 row."""
    vocab = z.shape[0]
    if done < min_tokens and st.stop_ids.size:
        z[st.stop_ids[st.stop_ids < vocab]] = -np.inf
    if st.bias_ids.size:
        ok = st.bias_ids < vocab
        z[st.bias_ids[ok]] += st.bias_values[ok]
    out_ids = np.fromiter(st.counts.keys(), np.int64, len(st.counts))
    if repetition != 1.0:
        seen = np.union1d(st.prompt_ids, out_ids)
        seen = seen[seen < vocab]
        v = z[seen]
        r = np.float32(repetition)
        z[seen] = np.where(v > 0, v / r, v * r)
    if out_ids.size and (frequency != 0.0 or presence != 0.0):
        cnt = np.fromiter(st.counts.values(), np.float32, len(st.counts))
        ok = out_ids < vocab
        out_ids, cnt = out_ids[ok], cnt[ok]
        if frequency != 0.0:
            z[out_ids] -= np.float32(frequency) * cnt
        if presence != 0.0:
            z[out_ids] -= np.float32(presence)


def min_p_filter(z: np.ndarray, temperature: float, min_p: float) -> None:
    """Step 6, in place: -inf where the probability after temperature is below min_p times the largest."""
    if min_p <= 0.0 or temperature <= 0.0:
        return  # greedy: the argmax always survives min_p
    scaled = (z - z.max()) / np.float32(max(temperature, 1e-30))  # as workers.sampling scales it
    z[scaled.astype(np.float64) < math.log(min_p)] = -np.inf


def sample_penalized(job: Job, logits: np.ndarray, lanes: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
                     book: PenaltyBook, masks: dict[int, LaneMask] | None = None) -> None:
    """Sample the penalised `lanes` of `logits` into `tokens`/`logprobs` (constrained ones under their masks)."""
    pen = job.penalties
    rows = np.array(logits[lanes], dtype=np.float32)  # a writable copy, whatever the source
    for j, lane in enumerate(lanes.tolist()):
        st = book.state(job, lane)
        z = rows[j]
        m = masks.get(lane) if masks else None
        if m is not None:
            if m.allow is not None:
                keep = z[m.allow]
                z[:] = -np.inf
                z[m.allow] = keep
            else:
                z[m.deny] = -np.inf
        penalize_row(z, st, int(pen.done[lane]), int(pen.min_tokens[lane]), float(pen.presence[lane]),
                     float(pen.frequency[lane]), float(pen.repetition[lane]))
        if not np.isfinite(z.max()):
            raise PenaltyError(f"lane {lane}: no token left to sample")
        if job.top_k[lane] != 1:
            min_p_filter(z, float(job.temperature[lane]), float(pen.min_p[lane]))
    t, _ = sample(rows, job.temperature[lanes], job.top_p[lanes], job.top_k[lanes], job.seed[lanes],
                  job.context_lens[lanes], np.zeros(lanes.shape[0], np.uint8))
    tokens[lanes] = t
    for lane, tok in zip(lanes.tolist(), t.tolist()):
        logprobs[lane] = token_logprob(logits[lane], tok) if job.want_logprobs[lane] else 0.0


@dataclass
class DevicePenalties:
    """A multi-step job's penalties as a device loop takes them (npuserve_chip.h's simpler_lane_penalties):
    per lane [B] the values, and each lane's counts before step 0 (distinct prompt/output ids, output counts)."""

    arrays: dict[str, np.ndarray]

    def c_arrays(self) -> dict[str, np.ndarray]:
        return self.arrays


def device_penalties(job: Job, book: PenaltyBook) -> DevicePenalties:
    """The penalties of a multi-step decode job's lanes, from `book` (each penalised lane's state advanced by
    its input token, as step 0 of the host loop would)."""
    pen = job.penalties
    b = job.batch
    on = (pen.active != 0) & (job.lane_valid != 0)
    seen_ids: list[np.ndarray] = []
    seen_counts: list[np.ndarray] = []
    bias_ids: list[np.ndarray] = []
    bias_values: list[np.ndarray] = []
    stop_ids: list[np.ndarray] = []
    for lane in range(b):
        if not on[lane]:
            for parts in (seen_ids, seen_counts, bias_ids, bias_values, stop_ids):
                parts.append(np.zeros(0, np.int32))
            continue
        st = book.state(job, lane)
        out = np.fromiter(st.counts.keys(), np.int32, len(st.counts))
        cnt = np.fromiter(st.counts.values(), np.int32, len(st.counts))
        ids = np.union1d(st.prompt_ids, out).astype(np.int32)
        counts = np.zeros(ids.shape[0], np.int32)
        counts[np.searchsorted(ids, out)] = cnt
        seen_ids.append(ids)
        seen_counts.append(counts)
        bias_ids.append(st.bias_ids)
        bias_values.append(st.bias_values)
        stop_ids.append(st.stop_ids)

    def starts(parts: list[np.ndarray]) -> np.ndarray:
        s = np.zeros(b + 1, np.int32)
        s[1:] = np.cumsum([p.shape[0] for p in parts])
        return s

    def cat(parts: list[np.ndarray], dtype) -> np.ndarray:
        return np.ascontiguousarray(np.concatenate(parts) if parts else np.zeros(0), dtype=dtype)

    def lanes(values: np.ndarray, neutral, dtype) -> np.ndarray:
        return np.ascontiguousarray(np.where(on, values, neutral), dtype=dtype)

    return DevicePenalties({
        "presence": lanes(pen.presence, 0.0, np.float32), "frequency": lanes(pen.frequency, 0.0, np.float32),
        "repetition": lanes(pen.repetition, 1.0, np.float32), "min_p": lanes(pen.min_p, 0.0, np.float32),
        "min_tokens": lanes(pen.min_tokens, 0, np.int32), "done": lanes(pen.done, 0, np.int32),
        "seen_start": starts(seen_ids), "seen_ids": cat(seen_ids, np.int32), "seen_counts": cat(seen_counts, np.int32),
        "bias_start": starts(bias_ids), "bias_ids": cat(bias_ids, np.int32),
        "bias_values": cat(bias_values, np.float32), "stop_start": starts(stop_ids), "stop_ids": cat(stop_ids, np.int32),
    })


def count_looped(job: Job, book: PenaltyBook, tokens: np.ndarray) -> None:
    """After a device loop ran `job`'s n steps (tokens [B, n]): count steps 0..n-2's samples (the inputs of
    steps 1..n-1) in the penalised lanes' states; the last one is the next job's input, counted then."""
    pen = job.penalties
    for lane in np.flatnonzero((pen.active != 0) & (job.lane_valid != 0)).tolist():
        st = book.state(job, lane)  # already advanced by the input token: no change
        for t in tokens[lane, :-1].tolist():
            st.count(int(t))
