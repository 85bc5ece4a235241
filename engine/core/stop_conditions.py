"""Stop conditions: max_tokens, EOS, stop token ids, multi-token stop sequences.

A stop sequence may span job boundaries and begin inside the continuation, so
the checker keeps a window of recent tokens.  Tokens that could still be the
start of a stop sequence are *held back* and only released once they cannot
be: a matched stop sequence is never shown to the client, as with string stops
in other serving APIs.  EOS and stop token ids end generation and are not
emitted either.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


class StopReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"


class StepVerdict(NamedTuple):
    """Result of feeding one sampled token: what may be emitted now, and whether to stop.

    A NamedTuple: one is made per generated token (half the cost of a dataclass), and callers unpack it."""

    emit: list[int]
    emit_logprobs: list[float]
    stop: StopReason | None


@dataclass
class StopChecker:
    max_tokens: int
    eos_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0  # stop sequences end nothing until more tokens than this were produced (vLLM's rule)
    produced: int = 0  # tokens counted toward max_tokens (continuation included)
    _window: list[int] = field(default_factory=list)  # last tokens, for sequence matching
    _held: list[int] = field(default_factory=list)
    _held_lp: list[float] = field(default_factory=list)

    @classmethod
    def build(cls, max_tokens: int, eos_ids: Sequence[int], ignore_eos: bool, stop_token_ids: Sequence[int],
              stop: Sequence[Sequence[int]], continuation: Sequence[int], min_tokens: int = 0) -> "StopChecker":
        seqs = tuple(tuple(int(t) for t in s) for s in stop if len(s) > 0)
        checker = cls(
            max_tokens=max_tokens,
            eos_ids=frozenset() if ignore_eos else frozenset(int(t) for t in eos_ids),
            stop_token_ids=frozenset(int(t) for t in stop_token_ids),
            stop_sequences=seqs,
            min_tokens=min_tokens,
        )
        checker.produced = len(continuation)
        keep = checker._window_len()
        checker._window = [int(t) for t in continuation[-keep:]] if keep else []
        return checker

    def _window_len(self) -> int:
        return max((len(s) for s in self.stop_sequences), default=0)

    def exhausted(self) -> bool:
        """True when max_tokens is already used up (a continuation that filled it)."""
        return self.produced >= self.max_tokens

    def feed(self, token: int, logprob: float = 0.0) -> StepVerdict:
        token = int(token)
        self.produced += 1
        if token in self.eos_ids:
            return self._stop(StopReason.EOS, flush=True)
        if token in self.stop_token_ids:
            return self._stop(StopReason.STOP, flush=True)
        if self.stop_sequences:
            keep = self._window_len()
            self._window.append(token)
            if len(self._window) > keep:
                del self._window[: len(self._window) - keep]
            self._held.append(token)
            self._held_lp.append(logprob)
            for s in self.stop_sequences if self.produced > self.min_tokens else ():
                if len(self._window) >= len(s) and tuple(self._window[-len(s):]) == s:
                    # Drop the part of the match still held; earlier parts
                    # (e.g. inside the continuation) were already shown.
                    n_hidden = min(len(s), len(self._held))
                    del self._held[len(self._held) - n_hidden:]
                    del self._held_lp[len(self._held_lp) - n_hidden:]
                    return self._stop(StopReason.STOP, flush=True)
            emit, emit_lp, _ = self._release_safe()
        else:
            emit, emit_lp = [token], [logprob]
        if self.produced >= self.max_tokens:
            emit += self._held
            emit_lp += self._held_lp
            self._held, self._held_lp = [], []
            return StepVerdict(emit, emit_lp, StopReason.LENGTH)
        return StepVerdict(emit, emit_lp, None)

    def _release_safe(self) -> StepVerdict:
        """Emit the held tokens that no stop sequence can still complete."""
        keep = 0
        held, window = self._held, self._window
        for s in self.stop_sequences:
            # longest suffix of the window (which may reach into the
            # continuation) that is a proper prefix of s
            for k in range(min(len(s) - 1, len(window)), 0, -1):
                if tuple(window[len(window) - k:]) == s[:k]:
                    keep = max(keep, min(k, len(held)))
                    break
        n_out = len(held) - keep
        out, out_lp = held[:n_out], self._held_lp[:n_out]
        self._held, self._held_lp = held[n_out:], self._held_lp[n_out:]
        return StepVerdict(out, out_lp, None)

    def _stop(self, reason: StopReason, flush: bool) -> StepVerdict:
        out, out_lp = (self._held, self._held_lp) if flush else ([], [])
        self._held, self._held_lp = [], []
        return StepVerdict(list(out), list(out_lp), reason)

    def flush(self) -> tuple[list[int], list[float]]:
        """Release everything held (the request ends for another reason)."""
        out, lp = self._held, self._held_lp
        self._held, self._held_lp = [], []
        return out, lp
