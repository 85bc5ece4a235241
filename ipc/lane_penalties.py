"""Sampling penalties of a job's lanes on the scheduler <-> worker wire (`ipc.records.Job.penalties`).

Present only when some lane of the job has one (presence, frequency or
repetition penalty, logit bias, min_p, min_tokens); a job without travels as
before. Per lane [B]: the request's scalars, its key (the request id: the
worker keeps the lane's token counts under it between jobs) and `done`, the
output tokens before the token this lane samples.

The lane that ends a (re)prefill (`rebuild`) also carries the request's
tokens so far (prompt, then output: `done` of them at the end), its logit
bias and the ids min_tokens masks (EOS, stop ids): the worker rebuilds the
counts from them, on any chip, after a requeue or a balancer resume. A
decode lane's input token is output token done-1, counted once (a retried
job counts nothing twice), as the constraint matcher is fed
(`workers.constraints`).

Three ring arrays (their layout is self-describing given B):
  pen_i32: active[B] rebuild[B] done[B] min_tokens[B] history_start[B+1] bias_start[B+1] stop_start[B+1]
           history[H] bias_ids[Q] stop_ids[S]
  pen_f32: presence[B] frequency[B] repetition[B] min_p[B] bias_values[Q]
  pen_u64: key[B]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

ARRAY_NAMES = ("pen_i32", "pen_f32", "pen_u64")


class LanePenalty(NamedTuple):
    """One lane's penalties as the scheduler describes them (`ipc.records.Lane.penalty`)."""

    key: int
    done: int
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    rebuild: bool = False
    history: Sequence[int] = ()  # rebuild lanes: prompt + output tokens so far
    bias_ids: Sequence[int] = ()  # rebuild lanes: logit_bias
    bias_values: Sequence[float] = ()
    stop_ids: Sequence[int] = ()  # rebuild lanes: what min_tokens masks


def _ragged(parts: list[Sequence], b: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    start = np.zeros(b + 1, np.int32)
    start[1:] = np.cumsum([len(p) for p in parts]) if parts else 0
    flat = np.fromiter((x for p in parts for x in p), dtype, int(start[-1]))
    return flat, start


@dataclass
class JobPenalties:
    active: np.ndarray  # u8/i32 [B]: the lane has penalties
    rebuild: np.ndarray  # [B]: the lane carries history, bias and stop ids
    done: np.ndarray  # i32 [B]
    min_tokens: np.ndarray  # i32 [B]
    presence: np.ndarray  # f32 [B]
    frequency: np.ndarray
    repetition: np.ndarray
    min_p: np.ndarray
    key: np.ndarray  # u64 [B]
    history: np.ndarray
    history_start: np.ndarray
    bias_ids: np.ndarray
    bias_values: np.ndarray
    bias_start: np.ndarray
    stop_ids: np.ndarray
    stop_start: np.ndarray

    @classmethod
    def build(cls, lanes: Sequence[LanePenalty | None], b: int) -> "JobPenalties":
        """From one entry per lane slot (None: no penalties; missing slots past len(lanes) too)."""
        lanes = list(lanes) + [None] * (b - len(lanes))
        z = LanePenalty(0, 0)
        ps = [p if p is not None else z for p in lanes]
        reb = [p if p is not None and p.rebuild else z for p in lanes]
        history, hs = _ragged([p.history for p in reb], b, np.int32)
        bias_ids, bs = _ragged([p.bias_ids for p in reb], b, np.int32)
        bias_values, _ = _ragged([p.bias_values for p in reb], b, np.float32)
        stop_ids, ss = _ragged([p.stop_ids for p in reb], b, np.int32)
        return cls(
            active=np.array([p is not None for p in lanes], np.int32),
            rebuild=np.array([p is not None and p.rebuild for p in lanes], np.int32),
            done=np.array([p.done for p in ps], np.int32), min_tokens=np.array([p.min_tokens for p in ps], np.int32),
            presence=np.array([p.presence for p in ps], np.float32),
            frequency=np.array([p.frequency for p in ps], np.float32),
            repetition=np.array([p.repetition for p in ps], np.float32),
            min_p=np.array([p.min_p for p in ps], np.float32),
            key=np.array([p.key & 0xFFFFFFFFFFFFFFFF for p in ps], np.uint64),
            history=history, history_start=hs, bias_ids=bias_ids, bias_values=bias_values, bias_start=bs,
            stop_ids=stop_ids, stop_start=ss,
        )

    def lane_history(self, lane: int) -> np.ndarray:
        return self.history[self.history_start[lane]:self.history_start[lane + 1]]

    def lane_bias(self, lane: int) -> tuple[np.ndarray, np.ndarray]:
        s = slice(self.bias_start[lane], self.bias_start[lane + 1])
        return self.bias_ids[s], self.bias_values[s]

    def lane_stop_ids(self, lane: int) -> np.ndarray:
        return self.stop_ids[self.stop_start[lane]:self.stop_start[lane + 1]]

    # -- wire ---------------------------------------------------------------------------------------------
    def array_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        b = self.active.shape[0]
        n32 = 4 * b + 3 * (b + 1) + self.history.size + self.bias_ids.size + self.stop_ids.size
        return {"pen_i32": ((n32,), "<i4"), "pen_f32": ((4 * b + self.bias_values.size,), "<f4"),
                "pen_u64": ((b,), "<u8")}

    def pack_into(self, dst) -> None:
        np.concatenate((self.active, self.rebuild, self.done, self.min_tokens, self.history_start, self.bias_start,
                        self.stop_start, self.history, self.bias_ids, self.stop_ids), out=dst["pen_i32"],
                       casting="unsafe")
        np.concatenate((self.presence, self.frequency, self.repetition, self.min_p, self.bias_values),
                       out=dst["pen_f32"], casting="unsafe")
        dst["pen_u64"][:] = self.key

    @classmethod
    def from_arrays(cls, a, b: int) -> "JobPenalties":
        """The penalties of a job of batch `b` from its ring arrays; ValueError when their sizes disagree."""
        i32, f32, u64 = a["pen_i32"], a["pen_f32"], a["pen_u64"]
        head = 4 * b + 3 * (b + 1)
        if u64.shape != (b,) or i32.ndim != 1 or i32.shape[0] < head or f32.ndim != 1 or f32.shape[0] < 4 * b:
            raise ValueError("penalty arrays: sizes disagree with the job's batch")
        o = 4 * b
        hs, bs, ss = i32[o:o + b + 1], i32[o + b + 1:o + 2 * b + 2], i32[o + 2 * b + 2:head]
        nh, nq, ns = int(hs[-1]), int(bs[-1]), int(ss[-1])
        if min(nh, nq, ns) < 0 or head + nh + nq + ns != i32.shape[0] or 4 * b + nq != f32.shape[0]:
            raise ValueError("penalty arrays: sizes disagree with their offsets")
        return cls(
            active=i32[:b], rebuild=i32[b:2 * b], done=i32[2 * b:3 * b], min_tokens=i32[3 * b:4 * b],
            presence=f32[:b], frequency=f32[b:2 * b], repetition=f32[2 * b:3 * b], min_p=f32[3 * b:4 * b],
            key=u64, history=i32[head:head + nh], history_start=hs, bias_ids=i32[head + nh:head + nh + nq],
            bias_values=f32[4 * b:], bias_start=bs, stop_ids=i32[head + nh + nq:], stop_start=ss,
        )

    def validate(self, b: int) -> None:
        """ValueError when the fields do not describe B lanes' penalties (the worker checks every job)."""
        for name in ("active", "rebuild", "done", "min_tokens", "presence", "frequency", "repetition", "min_p",
                     "key"):
            if getattr(self, name).shape != (b,):
                raise ValueError(f"penalties.{name} must have one entry per lane")
        for name, flat in (("history", self.history), ("bias", self.bias_ids), ("stop", self.stop_ids)):
            st = getattr(self, f"{name}_start")
            if st.shape != (b + 1,) or st[0] != 0 or st[-1] != flat.shape[0] or (b and np.diff(st).min() < 0):
                raise ValueError(f"penalties.{name}_start must have B+1 non-decreasing entries from 0 to its length")
        if self.bias_values.shape != self.bias_ids.shape:
            raise ValueError("penalties: bias values and ids differ in length")
        on = self.active != 0
        if (self.done[on] < 0).any() or (self.min_tokens[on] < 0).any() or not (self.repetition[on] > 0).all() \
                or not np.isfinite(self.presence[on]).all() or not np.isfinite(self.frequency[on]).all() \
                or not ((self.min_p[on] >= 0) & (self.min_p[on] <= 1)).all():
            raise ValueError("penalties: a lane's value is out of range")
        if ((self.rebuild != 0) & ~on).any():
            raise ValueError("penalties: a rebuild lane without penalties")
