"""Synthetic closed-loop workloads for the simulator: gaussian lengths, as docs/benchmarks.md (`npuserve simulate`)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class SimRequest:
    index: int
    prompt: list[int]
    max_tokens: int


def make_workload(n: int, prompt_mean: int = 1024, gen_mean: int = 256, *, prompt_sd: float = 200.0,
                  gen_sd: float = 50.0, vocab: int = 32000, max_seq: int = 2048, seed: int = 42) -> list[SimRequest]:
    """Gaussian prompt/generation lengths, clipped to fit max_seq.

    Floors of 64 prompt and 16 generated tokens when the means allow them, the same as `npuserve bench`'s
    `normal:` lengths (tools/load/workload.py), so a simulated run and a daemon's draw alike.
    """
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = max(64, int(rng.gauss(prompt_mean, prompt_sd))) if prompt_mean >= 64 else max(1, prompt_mean)
        g = max(16, int(rng.gauss(gen_mean, gen_sd))) if gen_mean >= 16 else max(1, gen_mean)
        p = min(p, max_seq - 1)
        g = max(1, min(g, max_seq - p))
        # Distinct random prompts: no accidental prefix-cache sharing between requests.
        out.append(SimRequest(i, [rng.randrange(1, vocab) for _ in range(p)], g))
    return out
