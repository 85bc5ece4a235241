"""One request run alone, in-process, on the `ref` backend: the expected tokens of any serving run.

Prefill then one decode step at a time, batch of one, fresh blocks: the
plainest possible run. A daemon (or balancer) serving the same prompt, seed
and sampling parameters must produce exactly these tokens, whatever else it
batches alongside, on whichever chip, after whatever retry -- the crosstalk
check of the ref daemon tests and of `npuserve soak`.
"""

from __future__ import annotations

import math

import numpy as np

from ipc.records import JobKind, Lane, build_job
from workers.backends.ref import RefBackend
from workers.sampling import sample


class Oracle:
    def __init__(self, package: str | None = None) -> None:
        self.backend = RefBackend()
        self.backend.load(package)  # None: the built-in tiny model
        info = self.backend.describe()
        self.eos = set(info.eos_ids)
        self.block_size = info.kv.block_size

    def run(self, prompt: list[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
            top_k: int = 0, seed: int = 0, ignore_eos: bool = False,
            logits_out: list | None = None) -> tuple[list[int], str]:
        """(generated tokens, finish reason "eos" | "length"); `logits_out` receives each step's logits row."""
        table = list(range(math.ceil((len(prompt) + max_tokens + 1) / self.block_size)))
        params = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        job = build_job(JobKind.PREFILL, [Lane(prompt, 0, table, **params)])
        out: list[int] = []
        pos = len(prompt)
        while True:
            step = self.backend.prefill(job) if job.kind == JobKind.PREFILL else self.backend.decode(job)
            tok, _ = sample(step.logits, job.temperature, job.top_p, job.top_k, job.seed, job.context_lens)
            if logits_out is not None:
                logits_out.append(np.array(step.logits[0], dtype=np.float64))
            t = int(tok[0])
            if t in self.eos and not ignore_eos:
                return out, "eos"
            out.append(t)
            if len(out) == max_tokens:
                return out, "length"
            job = build_job(JobKind.DECODE, [Lane([t], pos, table, **params)])
            pos += 1
