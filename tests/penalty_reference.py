"""A plain NumPy reference of sampling with penalties, written from the definitions (vLLM's semantics and the
project's seeded draw, docs/protocol.md), not from workers/sampling.py or workers/penalties.py: the tests
compare what the worker, the daemon and the HTTP front produce with it.

The draw: u = splitmix64-hash of (seed, position) as a float64 in [0, 1); candidates in token-id order
(plain temperature sampling) or by value descending then id (top-k); weights exp(scaled logit) in float64;
the first candidate whose cumulative weight exceeds u * total.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ipc.records import JobKind, Lane, build_job

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    h = _splitmix64((seed & _MASK) ^ _splitmix64((position * 0xD6E8FEB86659FD93) & _MASK))
    return (h >> 11) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class Params:
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def wire(self) -> dict:
        """The generate fields of these parameters (neutral ones left out)."""
        out = {"temperature": self.temperature, "top_k": self.top_k, "seed": self.seed}
        for k, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                           ("min_p", 0.0), ("min_tokens", 0)):
            if getattr(self, k) != neutral:
                out[k] = getattr(self, k)
        if self.logit_bias:
            out["logit_bias"] = {str(i): b for i, b in self.logit_bias}
        return out


def reference_token(logits: np.ndarray, prompt, output, p: Params, position: int, stop_ids=()) -> int:
    """The token sampled from one row of raw logits, given the prompt and the output so far."""
    f32 = np.float32
    z = np.array(logits, dtype=np.float32)
    if len(output) < p.min_tokens:
        for t in stop_ids:
            z[t] = -np.inf
    for t, b in p.logit_bias:
        z[t] = f32(z[t] + f32(b))
    if p.repetition_penalty != 1.0:
        r = f32(p.repetition_penalty)
        for t in set(prompt) | set(output):
            z[t] = z[t] / r if z[t] > 0 else z[t] * r
    for t, c in Counter(output).items():
        z[t] = f32(z[t] - f32(p.frequency_penalty) * f32(c))
        z[t] = f32(z[t] - f32(p.presence_penalty))
    if p.temperature <= 0.0 or p.top_k == 1:
        return int(np.argmax(z))
    scaled = (z - z.max()) / f32(p.temperature)
    ids = np.arange(z.shape[0])
    if p.min_p > 0:
        probs = np.exp(scaled.astype(np.float64))
        probs /= probs.sum()
        ids = ids[probs >= f32(p.min_p) * probs.max()]
    ids = ids[np.isfinite(scaled[ids])]
    if 0 < p.top_k < len(ids):
        order = sorted(ids.tolist(), key=lambda i: (-scaled[i], i))
        ids = np.array(order[:p.top_k])
    elif 0 < p.top_k:
        ids = np.array(sorted(ids.tolist(), key=lambda i: (-scaled[i], i)))
    w = np.exp(scaled[ids].astype(np.float64))
    cdf = np.cumsum(w)
    i = int(np.searchsorted(cdf, uniform(p.seed, position) * cdf[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])


class ModelSteps:
    """The model's logits step by step on an in-process backend (one lane, fresh blocks): prefill, then decodes."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.block_size = backend.describe().kv.block_size

    def run(self, prompt: list[int], max_tokens: int, p: Params, eos: set[int], stop_token_ids=(),
            continuation=(), masked=()) -> tuple[list[int], str]:
        """(output tokens after `continuation`, finish reason), sampled with `reference_token`; `masked`: more
        ids min_tokens masks (an EOS the request ignores)."""
        toks = list(prompt) + list(continuation)
        table = list(range(math.ceil((len(toks) + max_tokens + 1) / self.block_size)))
        step = self.backend.prefill(build_job(JobKind.PREFILL, [Lane(toks, 0, table)]))
        output = list(continuation)
        stop_ids = sorted(set(eos) | set(stop_token_ids) | set(masked))
        while True:
            t = reference_token(step.logits[0], prompt, output, p, len(prompt) + len(output), stop_ids)
            if t in eos:
                return output[len(continuation):], "eos"
            if t in stop_token_ids:
                return output[len(continuation):], "stop"
            output.append(t)
            if len(output) == max_tokens:
                return output[len(continuation):], "length"
            step = self.backend.decode(build_job(JobKind.DECODE, [Lane([t], len(prompt) + len(output) - 1, table)]))
