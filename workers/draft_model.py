"""A draft model in the worker: a second, smaller model with the same tokenizer proposes the drafts.

It runs beside the target on the same chip, with its own KV in its own
backend, addressed by the *same* block ids: every job the target runs is
mirrored on the draft (`mirror`: the same tokens at the same positions and
block tables, no sampling), so the draft's KV at a block id always holds
the same tokens as the target's, prefix-cache sharing, rollback and release
included (a rejected draft's slot is rewritten by the lane's next job, as on
the target). For a lane marked `draft_src`, `propose` runs k greedy draft
steps from the lane's last real token and writes the proposals into the
job's tokens before the target verifies them; greedy proposals are a
point-mass proposal, so `workers.spec_verify` keeps the output exactly the
target's. Only the last draft's KV is left for `mirror` to write.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ipc.records import Job, JobKind, Lane, build_job
from workers.backends.base import ChipBackend


class DraftModel:
    def __init__(self, backend: ChipBackend) -> None:
        self.backend = backend

    @staticmethod
    def _table(job: Job, lane: int) -> list[int]:
        row = job.block_tables[lane]
        return row[row >= 0].tolist()

    def propose(self, job: Job) -> Job:
        """The job with its draft-model lanes' placeholder drafts replaced by the draft's greedy proposals."""
        src = [int(i) for i in np.flatnonzero((job.draft_src != 0) & (job.lane_valid != 0))]
        if not src:
            return job
        tokens = np.array(job.tokens, np.int32)
        ends = job.query_start[1:].tolist()
        dl = job.draft_lens.tolist()
        first = {lane: ends[lane] - dl[lane] - 1 for lane in src}  # index of the lane's last real token
        for step in range(max(dl[lane] for lane in src)):
            active = [lane for lane in src if dl[lane] > step]
            lanes = [Lane([int(tokens[first[lane] + step])], int(job.positions[first[lane]]) + step,
                          self._table(job, lane)) for lane in active]
            out = self.backend.prefill(build_job(JobKind.PREFILL, lanes))
            top = out.logits[:len(active)]
            for row, lane in enumerate(active):
                tokens[first[lane] + step + 1] = int(np.argmax(top[row]))
        return dataclasses.replace(job, tokens=tokens)

    def mirror(self, job: Job) -> None:
        """Write on the draft the KV the target's job wrote (draft-model lanes: only their last draft)."""
        lanes = []
        src = job.draft_src
        for lane in np.flatnonzero(job.lane_valid).tolist():
            toks, pos = job.lane_tokens(lane), job.lane_positions(lane)
            if len(toks) == 0:
                continue
            if src.size and src[lane]:
                toks, pos = toks[-1:], pos[-1:]
            lanes.append(Lane(toks.tolist(), int(pos[0]), self._table(job, lane), sample=False))
        if lanes:
            self.backend.prefill(build_job(JobKind.PREFILL, lanes))

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.backend.copy_blocks(src, dst)

    def release_blocks(self, blocks: list[int]) -> None:
        self.backend.release_blocks(blocks)
