"""Job and result records: the scheduler <-> worker wire format.

Both sides import these layouts from `ipc` so that the worker never imports
`engine`. A record is a dict of named numpy arrays, which is exactly what a
shared-memory ring record holds (`ipc.ring`); scalars travel in a small int64
`meta` array so that one ring record carries one whole job.

Layout of a job (B = the compiled batch of the profile, 1 for prefill):

* tokens[T] int32, positions[T] int32: the new tokens of every lane, packed.
* query_start[B+1] int32: lane i owns tokens[query_start[i]:query_start[i+1]].
  Decode jobs have exactly one token per *valid* lane; inactive lanes own none.
* lane_valid[B] uint8: 0 for an inactive lane. A backend must not read inputs
  nor write KV for an inactive lane (the "mask" inactive-lane policy); it is
  never fed a made-up token 0.
* context_lens[B] int32: the KV length of the lane *after* this job
  (= last position + 1); 0 for inactive lanes.
* block_tables[B, M] int32: physical KV block ids of each lane, -1 padded.
* sample[B] uint8: produce a token for this lane (0 for a non-final prefill chunk).
* temperature[B] f32, top_p[B] f32, top_k[B] int32 (0 = off), seed[B] uint64:
  sampling parameters. Sampling is deterministic per (seed, position of the
  sampled token) where that position is context_lens[lane].
* want_logprobs[B] uint8.
* src_blocks[K], dst_blocks[K] int32: block ids for KV copy / swap jobs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class JobKind(enum.IntEnum):
    PREFILL = 1
    DECODE = 2
    KV_COPY = 3


class JobStatus(enum.IntEnum):
    OK = 0
    FAILED = 1  # device-level failure: every lane of the job failed, KV unknown
    INVALID = 2  # the worker rejected the job's inputs before running it


_META_LEN = 8
_EMPTY_I32 = np.zeros(0, dtype=np.int32)


def _i32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


@dataclass
class Job:
    job_id: int
    generation: int
    kind: JobKind
    tokens: np.ndarray
    positions: np.ndarray
    query_start: np.ndarray
    lane_valid: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    sample: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    seed: np.ndarray
    want_logprobs: np.ndarray
    return_logits: bool = False
    src_blocks: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    dst_blocks: np.ndarray = field(default_factory=lambda: _EMPTY_I32)

    @property
    def batch(self) -> int:
        return int(self.lane_valid.shape[0])

    def lane_tokens(self, lane: int) -> np.ndarray:
        return self.tokens[self.query_start[lane] : self.query_start[lane + 1]]

    def lane_positions(self, lane: int) -> np.ndarray:
        return self.positions[self.query_start[lane] : self.query_start[lane + 1]]

    def validate(self) -> None:
        """Raise ValueError when the arrays do not describe one coherent job."""
        b = self.batch
        if self.kind == JobKind.KV_COPY:
            if self.src_blocks.shape != self.dst_blocks.shape:
                raise ValueError("src_blocks and dst_blocks differ in length")
            return
        if self.query_start.shape != (b + 1,) or self.query_start[0] != 0:
            raise ValueError("query_start must have B+1 entries starting at 0")
        if np.any(np.diff(self.query_start) < 0) or self.query_start[-1] != self.tokens.shape[0]:
            raise ValueError("query_start must be non-decreasing and end at len(tokens)")
        if self.positions.shape != self.tokens.shape:
            raise ValueError("positions and tokens differ in length")
        for name in ("context_lens", "sample", "temperature", "top_p", "top_k", "seed", "want_logprobs"):
            if getattr(self, name).shape != (b,):
                raise ValueError(f"{name} must have one entry per lane")
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != b:
            raise ValueError("block_tables must be [B, M]")
        for lane in range(b):
            n = int(self.query_start[lane + 1] - self.query_start[lane])
            if not self.lane_valid[lane]:
                if n:
                    raise ValueError(f"inactive lane {lane} carries tokens")
                continue
            if self.kind == JobKind.DECODE and n != 1:
                raise ValueError(f"decode lane {lane} must carry exactly one token")
            if n and int(self.lane_positions(lane)[-1]) + 1 != int(self.context_lens[lane]):
                raise ValueError(f"lane {lane}: context_lens must be last position + 1")

    def to_arrays(self) -> dict[str, np.ndarray]:
        meta = np.zeros(_META_LEN, dtype=np.int64)
        meta[:4] = (self.job_id, self.generation, int(self.kind), int(self.return_logits))
        return {
            "meta": meta,
            "tokens": _i32(self.tokens),
            "positions": _i32(self.positions),
            "query_start": _i32(self.query_start),
            "lane_valid": np.ascontiguousarray(self.lane_valid, dtype=np.uint8),
            "context_lens": _i32(self.context_lens),
            "block_tables": _i32(self.block_tables),
            "sample": np.ascontiguousarray(self.sample, dtype=np.uint8),
            "temperature": np.ascontiguousarray(self.temperature, dtype=np.float32),
            "top_p": np.ascontiguousarray(self.top_p, dtype=np.float32),
            "top_k": _i32(self.top_k),
            "seed": np.ascontiguousarray(self.seed, dtype=np.uint64),
            "want_logprobs": np.ascontiguousarray(self.want_logprobs, dtype=np.uint8),
            "src_blocks": _i32(self.src_blocks),
            "dst_blocks": _i32(self.dst_blocks),
        }

    @classmethod
    def from_arrays(cls, a) -> "Job":
        """Build a Job from a mapping of arrays (ring views are copied out)."""
        meta = np.asarray(a["meta"])
        return cls(
            job_id=int(meta[0]),
            generation=int(meta[1]),
            kind=JobKind(int(meta[2])),
            return_logits=bool(meta[3]),
            **{k: np.array(a[k]) for k in _JOB_ARRAYS},
        )

    @classmethod
    def kv_copy(cls, job_id: int, generation: int, src, dst) -> "Job":
        z = np.zeros(0, dtype=np.int32)
        return cls(
            job_id=job_id, generation=generation, kind=JobKind.KV_COPY,
            tokens=z, positions=z, query_start=np.zeros(1, np.int32),
            lane_valid=np.zeros(0, np.uint8), context_lens=z,
            block_tables=np.zeros((0, 0), np.int32), sample=np.zeros(0, np.uint8),
            temperature=np.zeros(0, np.float32), top_p=np.zeros(0, np.float32),
            top_k=z, seed=np.zeros(0, np.uint64), want_logprobs=np.zeros(0, np.uint8),
            src_blocks=_i32(src), dst_blocks=_i32(dst),
        )


_JOB_ARRAYS = (
    "tokens", "positions", "query_start", "lane_valid", "context_lens", "block_tables",
    "sample", "temperature", "top_p", "top_k", "seed", "want_logprobs", "src_blocks", "dst_blocks",
)


@dataclass
class JobResult:
    """What a worker returns for one job. tokens[lane] is -1 where nothing was sampled."""

    job_id: int
    generation: int
    kind: JobKind
    status: JobStatus
    tokens: np.ndarray  # int32 [B]
    logprobs: np.ndarray  # float32 [B]
    logits: np.ndarray | None = None  # float32 [B, V] when the job asked for them
    device_us: int = 0  # time spent in the backend call
    worker_us: int = 0  # time from reading the job to writing this result

    def to_arrays(self) -> dict[str, np.ndarray]:
        meta = np.zeros(_META_LEN, dtype=np.int64)
        meta[:6] = (self.job_id, self.generation, int(self.kind), int(self.status), self.device_us, self.worker_us)
        out = {
            "meta": meta,
            "tokens": _i32(self.tokens),
            "logprobs": np.ascontiguousarray(self.logprobs, dtype=np.float32),
        }
        if self.logits is not None:
            out["logits"] = np.ascontiguousarray(self.logits, dtype=np.float32)
        return out

    @classmethod
    def from_arrays(cls, a) -> "JobResult":
        meta = np.asarray(a["meta"])
        logits = a["logits"] if "logits" in a else None
        return cls(
            job_id=int(meta[0]),
            generation=int(meta[1]),
            kind=JobKind(int(meta[2])),
            status=JobStatus(int(meta[3])),
            device_us=int(meta[4]),
            worker_us=int(meta[5]),
            tokens=np.array(a["tokens"]),
            logprobs=np.array(a["logprobs"]),
            logits=None if logits is None else np.array(logits),
        )

    @classmethod
    def failed(cls, job: Job, status: JobStatus = JobStatus.FAILED) -> "JobResult":
        b = job.batch
        return cls(
            job_id=job.job_id, generation=job.generation, kind=job.kind, status=status,
            tokens=np.full(b, -1, np.int32), logprobs=np.zeros(b, np.float32),
        )
