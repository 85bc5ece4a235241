"""Job and result records: the scheduler <-> worker wire format.

Both sides import these layouts from `ipc` so that the worker never imports
`engine`. A record is a dict of named numpy arrays, which is exactly what a
shared-memory ring record holds (`ipc.ring`), so one ring record carries one
whole job. On the wire a job's fields are grouped by dtype into four blobs
(`i32`, `f32`, `u8`, `u64`) plus an int64 `meta` with the scalars and every
field's shape: each ring array costs Python work on both sides, and a job has
fourteen. `Job.from_arrays(rec, copy=False)` gives the fields back as views.

Fields of a job (B = the compiled batch of the profile, 1 for prefill):

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
* want_logprobs[B] uint8: 0 none, 1 the sampled token's logprob; larger values also ask for the top-k
  alternatives and the prompt's logprobs (`ipc.logprob_wants`).
* src_blocks[K], dst_blocks[K] int32: block ids for KV copy jobs; for KV_EXPORT device blocks -> host
  slots, for KV_IMPORT host slots -> device blocks (the host tier, `ipc.kv_slots`).
* draft_lens[B] int32 (optional, empty = none): speculative verification. The
  last draft_lens[i] tokens of lane i are draft tokens after its last real
  token; the worker samples every one of those positions and returns the
  longest accepted prefix (`JobResult.accepted`) plus the next token.
* draft_src[B] uint8 (optional, empty = none): 1 where the worker's draft
  model proposes lane i's drafts (the tokens sent there are placeholders);
  the accepted ones come back in `JobResult.accepted_tokens`.
  Both travel after every other field of their blob (sizes in meta[24:26]).
* adapter[B] int32 (optional, empty = every lane on the base model): the
  board's number of the LoRA adapter lane i runs under, -1 = the base model.
  The worker swaps the adapters into device slots (`workers.lora`). It travels
  last in the i32 blob (size in meta[27]).
* imports (optional, prefill jobs only): host/disk-tier blocks the worker
  writes before the prefill, each naming the lane that depends on it
  (`ipc.lane_imports`): one extra ring array, sent only to workers that
  announce `lane_imports`. The result's `refused[B]` names the lanes whose
  import was refused (those wrote nothing and were not run).

Constrained decoding (structured output), present only when some lane is
constrained (C = B then; else C = 0 and they are empty):

* constraint_id[C] uint64: the hash of the lane's compiled grammar, 0 = none.
* constraint_key[C] uint64: the request the lane belongs to: the worker keeps
  the constraint state of each request under it between jobs.
* constraint_done[C] int32: how many output tokens come before the token this
  lane samples. A decode lane's input token is output token done-1, which the
  worker feeds to the lane's matcher once (a retried job feeds nothing new).
  On a lane with drafts, `done` counts up to its last real token (the drafts
  are not output yet).
* replay[R] int32 with replay_start[C+1]: for a sampling prefill lane, its
  output tokens so far (`done` of them; a requeued or resumed request), which
  rebuild the state from the grammar: deterministic, on any chip.
* grammar[G] uint8 with grammar_start[C+1]: for a sampling prefill lane, the
  UTF-8 llguidance grammar (decode lanes carry only the id).

Sampling penalties (presence/frequency/repetition, logit bias, min_p,
min_tokens), present only when some lane has one: `Job.penalties`, three
extra ring arrays laid out by `ipc.lane_penalties`.

A decode lane's token may be QUEUED_STEP_TOKEN (-1) instead of an id: "the token
this lane's previous job samples", so the scheduler can queue step N+1 while
step N runs and the chip need not wait for the scheduler's turn between steps
(`executor.queue_next_step`, docs/architecture.md). The worker resolves it
from its own last sample for the lane, found by (position, the block holding
position - 1): that block was written by step N, so no other lane holds it
then. A queued-step token it cannot resolve (step N failed) makes the job INVALID.
The worker keeps the samples only of jobs that have `queue_next_step` set (meta[26]:
the scheduler queues next steps), not one dict entry per generated token for
nothing.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ipc.lane_imports import ARRAY_NAME as _IMPORTS_ARRAY, LaneImports
from ipc.lane_penalties import ARRAY_NAMES as _PENALTY_ARRAYS, JobPenalties, LanePenalty


class JobKind(enum.IntEnum):
    PREFILL = 1
    DECODE = 2
    KV_COPY = 3
    KV_EXPORT = 4  # src_blocks: device blocks -> dst_blocks: host slots (ipc.kv_slots records)
    KV_IMPORT = 5  # src_blocks: host slots -> dst_blocks: device blocks (refused whole when a record is bad)


TRANSFER_KINDS = (JobKind.KV_COPY, JobKind.KV_EXPORT, JobKind.KV_IMPORT)


class JobStatus(enum.IntEnum):
    OK = 0
    FAILED = 1  # device-level failure: every lane of the job failed, KV unknown
    INVALID = 2  # the worker rejected the job's inputs before running it


# value -> member, for the per-record decodes (an IntEnum's call costs ~1 us of Python)
_KIND_OF = {k.value: k for k in JobKind}
_STATUS_OF = {k.value: k for k in JobStatus}


def _member(table: dict, enum_cls: type, value: int):
    m = table.get(value)
    return enum_cls(value) if m is None else m  # an unknown value raises ValueError, as the enum call did


QUEUED_STEP_TOKEN = -1  # a lane's token: the one the lane's previous job samples (resolved by the worker)


class ResultMeta:
    """The slots of a result record's int64 `meta`, by index: the worker writes them, `JobResult` reads them.

    Plain int constants, not an IntEnum: reading an enum member costs ~0.5 us on Python 3.11, and the
    daemon reads ten per result. The values are the wire layout (one int64 per slot, in this order).
    """

    JOB_ID = 0
    GENERATION = 1
    KIND = 2  # JobKind
    STATUS = 3  # JobStatus
    DEVICE_US = 4
    WORKER_US = 5
    MASKS = 6
    MASK_US = 7
    DEVICE_START_NS = 8
    IDLE_US = 9  # the last slot: a record of an older worker stops after MASK_US
    LEN = 10


RESULT_META_LEN = ResultMeta.LEN
# 4 scalars, 15 field sizes, submitted_ns, 3 constraint sizes (C, R, G), decode_steps, 2 draft sizes, queue_next_step,
# adapter size
_JOB_META_LEN = 28
_EMPTY_I32 = np.zeros(0, dtype=np.int32)
_EMPTY_U64 = np.zeros(0, dtype=np.uint64)
_EMPTY_U8 = np.zeros(0, dtype=np.uint8)


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
    # time.monotonic_ns() when the scheduler process handed the job to the chip
    # (CLOCK_MONOTONIC is system-wide); 0 = unknown. A backend that models a
    # device queue (sim) starts the job no earlier than this.
    submitted_ns: int = 0
    # Multi-step decode (executor.decode_steps): a decode job the worker runs this many steps before
    # it answers (one host round trip per n tokens instead of per token), each step's input the token the
    # step before sampled; its result's tokens are [B, n]. The
    # scheduler truncates each lane at its end (EOS, stop, max tokens) and rolls the KV past it back.
    decode_steps: int = 1
    # Queued next steps (executor.queue_next_step): the scheduler may queue a step behind this job's lanes
    # naming QUEUED_STEP_TOKEN, so the worker keeps their samples (otherwise it keeps none: work per token).
    queue_next_step: bool = False
    constraint_id: np.ndarray = field(default_factory=lambda: _EMPTY_U64)
    constraint_key: np.ndarray = field(default_factory=lambda: _EMPTY_U64)
    constraint_done: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    replay: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    replay_start: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    grammar: np.ndarray = field(default_factory=lambda: _EMPTY_U8)
    grammar_start: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    # speculative verification: draft tokens at the end of each lane ([B] or empty: no drafts)
    draft_lens: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    draft_src: np.ndarray = field(default_factory=lambda: _EMPTY_U8)
    # sampling penalties (ipc.lane_penalties): None when no lane has any; three extra ring arrays otherwise
    penalties: JobPenalties | None = None
    # LoRA: per lane, the board's adapter number (-1 = base model); empty = no lane has an adapter
    adapter: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    # prefill jobs: tier blocks the worker imports first, each naming the lane that depends on it
    # (ipc.lane_imports); None = none. One extra ring array, sent only to workers that announce it.
    imports: LaneImports | None = None

    @property
    def constrained(self) -> bool:
        return self.constraint_id.shape[0] != 0

    def lane_replay(self, lane: int) -> np.ndarray:
        return self.replay[self.replay_start[lane]:self.replay_start[lane + 1]]

    def lane_grammar(self, lane: int) -> str:
        return bytes(self.grammar[self.grammar_start[lane]:self.grammar_start[lane + 1]]).decode("utf-8")

    @property
    def batch(self) -> int:
        return int(self.lane_valid.shape[0])

    def lane_tokens(self, lane: int) -> np.ndarray:
        return self.tokens[self.query_start[lane] : self.query_start[lane + 1]]

    def lane_positions(self, lane: int) -> np.ndarray:
        return self.positions[self.query_start[lane] : self.query_start[lane + 1]]

    def validate(self) -> None:
        """Raise ValueError when the arrays do not describe one coherent job.

        Vectorised, because the worker runs it on every job: its cost does not
        grow with B. It names the first offending lane, with the message a
        lane-by-lane check would give.
        """
        b = self.batch
        if self.imports is not None and self.kind != JobKind.PREFILL:
            raise ValueError("only a prefill job carries imports")
        if self.kind in TRANSFER_KINDS:
            if self.src_blocks.shape != self.dst_blocks.shape:
                raise ValueError("src_blocks and dst_blocks differ in length")
            return
        if self.lane_valid.ndim != 1:
            raise ValueError("lane_valid must be [B]")
        qs = self.query_start
        if qs.shape != (b + 1,) or qs[0] != 0:
            raise ValueError("query_start must have B+1 entries starting at 0")
        ends = qs[1:]
        counts = ends - qs[:-1]
        if (b and counts.min() < 0) or qs[-1] != self.tokens.shape[0]:
            raise ValueError("query_start must be non-decreasing and end at len(tokens)")
        if self.positions.shape != self.tokens.shape:
            raise ValueError("positions and tokens differ in length")
        for name in _LANE_FIELDS:
            if getattr(self, name).shape != (b,):
                raise ValueError(f"{name} must have one entry per lane")
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != b:
            raise ValueError("block_tables must be [B, M]")
        if self.constrained:
            self._validate_constraints(b)
        if self.penalties is not None:
            self.penalties.validate(b)
        if self.imports is not None:
            self.imports.validate(b)
        valid = self.lane_valid != 0
        # a valid decode lane carries exactly one token; an inactive lane never carries any
        bad_count = counts != valid if self.kind == JobKind.DECODE else (counts != 0) > valid
        has = counts != 0
        # qs runs from 0 to len(tokens) without decreasing, so ends - 1 indexes each lane's last token
        last = self.positions[ends[has] - 1].astype(np.int64)
        bad_ctx = last + 1 != self.context_lens[has].astype(np.int64)
        if bad_count.any() or bad_ctx.any():
            wrong_ctx = np.zeros(b, bool)
            wrong_ctx[has] = bad_ctx
            lane = int((bad_count | wrong_ctx).argmax())
            if not bad_count[lane]:
                raise ValueError(f"lane {lane}: context_lens must be last position + 1")
            if not valid[lane]:
                raise ValueError(f"inactive lane {lane} carries tokens")
            raise ValueError(f"decode lane {lane} must carry exactly one token")
        if self.draft_lens.size:
            if self.draft_lens.shape != (b,):
                raise ValueError("draft_lens must have one entry per lane")
            dl = self.draft_lens
            bad = (dl < 0) | (dl >= np.maximum(counts, 1)) | ((dl > 0) & (self.sample == 0))
            if bad.any():
                raise ValueError(f"lane {int(bad.argmax())}: draft_lens must be below its token count, on a sampled lane")
        if self.draft_src.size and (self.draft_src.shape != (b,) or not self.draft_lens.size):
            raise ValueError("draft_src must have one entry per lane, beside draft_lens")
        if self.adapter.size and (self.adapter.shape != (b,) or self.adapter.min() < -1):
            raise ValueError("adapter must have one entry per lane, each an adapter number or -1")

    def _validate_constraints(self, b: int) -> None:
        for name in ("constraint_id", "constraint_key", "constraint_done"):
            if getattr(self, name).shape != (b,):
                raise ValueError(f"{name} must have one entry per lane")
        for name, blob in (("replay", self.replay), ("grammar", self.grammar)):
            st = getattr(self, f"{name}_start")
            if st.shape != (b + 1,) or st[0] != 0 or st[-1] != blob.shape[0] or (b and np.diff(st).min() < 0):
                raise ValueError(f"{name}_start must have B+1 non-decreasing entries from 0 to len({name})")

    # -- wire format ------------------------------------------------------
    def array_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """{name: (shape, dtype str)} of the record `pack_into` fills (reserve ring space with it)."""
        n32, nf32, nu8, n64 = self._group_sizes()
        spec = {"meta": ((_JOB_META_LEN,), "<i8"), "i32": ((n32,), "<i4"), "f32": ((nf32,), "<f4"),
                "u8": ((nu8,), "|u1"), "u64": ((n64,), "<u8")}
        if self.penalties is not None:
            spec.update(self.penalties.array_spec())
        if self.imports is not None:
            spec.update(self.imports.array_spec())
        return spec

    def _group_sizes(self) -> tuple[int, int, int, int]:
        bt = self.block_tables
        if bt.ndim != 2:
            raise ValueError(f"block_tables must be 2-D to be sent, not {bt.ndim}-D")
        for name in _FLAT_FIELDS:
            if getattr(self, name).ndim != 1:
                raise ValueError(f"{name} must be 1-D to be sent")
        return (
            self.tokens.size + self.positions.size + self.query_start.size + self.context_lens.size + self.top_k.size
            + bt.size + self.src_blocks.size + self.dst_blocks.size
            + self.constraint_done.size + self.replay.size + self.replay_start.size + self.grammar_start.size
            + self.draft_lens.size + self.adapter.size,
            self.temperature.size + self.top_p.size,
            self.lane_valid.size + self.sample.size + self.want_logprobs.size + self.grammar.size + self.draft_src.size,
            self.seed.size + self.constraint_id.size + self.constraint_key.size,
        )

    def pack_into(self, dst) -> None:
        """Write this job into arrays shaped by `array_spec()` (e.g. reserved ring space).

        Why packed: a ring record costs Python work per array, and a job has
        fourteen; grouped by dtype they travel as four blobs plus `meta`,
        which holds the scalars and every field's shape.
        """
        bt = self.block_tables
        n32_plain = (self.tokens.size + self.positions.size + self.query_start.size + self.context_lens.size
                     + self.top_k.size + bt.size + self.src_blocks.size + self.dst_blocks.size)
        nu8_plain = self.lane_valid.size + self.sample.size + self.want_logprobs.size
        n64_plain = self.seed.size
        dst["meta"][:] = (
            self.job_id, self.generation, int(self.kind), int(self.return_logits),
            self.tokens.size, self.positions.size, self.query_start.size, self.context_lens.size,
            self.top_k.size, bt.shape[0], bt.shape[1], self.src_blocks.size, self.dst_blocks.size,
            self.temperature.size, self.top_p.size, self.lane_valid.size, self.sample.size,
            self.want_logprobs.size, self.seed.size, self.submitted_ns,
            self.constraint_id.size, self.replay.size, self.grammar.size, self.decode_steps,
            self.draft_lens.size, self.draft_src.size, int(self.queue_next_step), self.adapter.size,
        )
        np.concatenate((self.tokens, self.positions, self.query_start, self.context_lens, self.top_k,
                        bt.ravel(), self.src_blocks, self.dst_blocks), out=dst["i32"][:n32_plain], casting="unsafe")
        np.concatenate((self.temperature, self.top_p), out=dst["f32"], casting="unsafe")
        np.concatenate((self.lane_valid, self.sample, self.want_logprobs), out=dst["u8"][:nu8_plain],
                       casting="unsafe")
        dst["u64"][:n64_plain] = self.seed
        if self.constrained:
            n32_c = n32_plain + self.constraint_done.size + self.replay.size + self.replay_start.size \
                + self.grammar_start.size
            np.concatenate((self.constraint_done, self.replay, self.replay_start, self.grammar_start),
                           out=dst["i32"][n32_plain:n32_c], casting="unsafe")
            dst["u8"][nu8_plain:nu8_plain + self.grammar.size] = self.grammar
            np.concatenate((self.constraint_id, self.constraint_key), out=dst["u64"][n64_plain:], casting="unsafe")
        end32 = dst["i32"].shape[0]
        if self.adapter.size:  # the last field of the i32 blob
            dst["i32"][end32 - self.adapter.size:] = self.adapter
            end32 -= self.adapter.size
        if self.draft_lens.size:  # speculative verification: after every other field of the blob but adapter
            dst["i32"][end32 - self.draft_lens.size:end32] = self.draft_lens
        if self.draft_src.size:
            dst["u8"][dst["u8"].shape[0] - self.draft_src.size:] = self.draft_src
        if self.penalties is not None:
            self.penalties.pack_into(dst)
        if self.imports is not None:
            self.imports.pack_into(dst)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The job as a ring record: {name: array}. Raises ValueError for a field of the wrong rank."""
        out = {k: np.empty(shape, dt) for k, (shape, dt) in self.array_spec().items()}
        self.pack_into(out)
        return out

    @classmethod
    def from_arrays(cls, a, copy: bool = True) -> "Job":
        """Build a Job from a mapping of arrays made by `to_arrays`/`pack_into`.

        copy=True copies out of the mapping (ring views die at release);
        copy=False makes the fields views of `a` -- the worker's zero-copy
        path, valid only while the ring record is held.
        """
        m = a["meta"].tolist()
        if len(m) != _JOB_META_LEN or min(m[4:19]) < 0 or min(m[20:23]) < 0 or min(m[24:26]) < 0 or m[27] < 0:
            raise ValueError(f"job record: a meta of {len(m)} entries (not {_JOB_META_LEN}) or a negative size")
        i32, f32, u8, u64 = a["i32"], a["f32"], a["u8"], a["u64"]
        if copy:
            i32, f32, u8, u64 = np.array(i32), np.array(f32), np.array(u8), np.array(u64)
        nt, npos, nqs, nctx, ntk, b0, b1, nsrc, ndst, ntemp, ntp, nlv, nsm, nwl, nseed = m[4:19]
        nc, nrep, ngr = m[20:23]
        ndl, nds = m[24:26]
        nad = m[27]
        nst = nc + 1 if nc else 0
        o1 = nt
        o2 = o1 + npos
        o3 = o2 + nqs
        o4 = o3 + nctx
        o5 = o4 + ntk
        o6 = o5 + b0 * b1
        o7 = o6 + nsrc
        o8 = o7 + ndst
        u = nlv + nsm + nwl
        if o8 + nc + nrep + 2 * nst + ndl + nad != i32.shape[0] or ntemp + ntp != f32.shape[0] \
                or u + ngr + nds != u8.shape[0] \
                or nseed + 2 * nc != u64.shape[0]:
            raise ValueError("job record: array sizes disagree with its meta")
        extra = {}
        if nc:
            o9 = o8 + nc
            o10 = o9 + nrep
            o11 = o10 + nst
            extra = dict(constraint_done=i32[o8:o9], replay=i32[o9:o10], replay_start=i32[o10:o11],
                         grammar_start=i32[o11:o11 + nst], grammar=u8[u:u + ngr], constraint_id=u64[nseed:nseed + nc],
                         constraint_key=u64[nseed + nc:])
        n32 = i32.shape[0]
        if nad:
            extra["adapter"] = i32[n32 - nad:]
        if ndl:
            extra["draft_lens"] = i32[n32 - nad - ndl:n32 - nad]
        if nds:
            extra["draft_src"] = u8[u8.shape[0] - nds:]
        if _PENALTY_ARRAYS[0] in a:
            pen = {k: (np.array(a[k]) if copy else a[k]) for k in _PENALTY_ARRAYS}
            extra["penalties"] = JobPenalties.from_arrays(pen, nlv)
        if _IMPORTS_ARRAY in a:
            extra["imports"] = LaneImports.from_arrays(a, copy)
        return cls(
            job_id=m[0], generation=m[1], kind=_member(_KIND_OF, JobKind, m[2]), return_logits=bool(m[3]),
            tokens=i32[:o1], positions=i32[o1:o2], query_start=i32[o2:o3], context_lens=i32[o3:o4],
            top_k=i32[o4:o5], block_tables=i32[o5:o6].reshape(b0, b1), src_blocks=i32[o6:o7],
            dst_blocks=i32[o7:o8], temperature=f32[:ntemp], top_p=f32[ntemp:], lane_valid=u8[:nlv],
            sample=u8[nlv:nlv + nsm], want_logprobs=u8[nlv + nsm:u], seed=u64[:nseed], submitted_ns=m[19], decode_steps=max(1, m[23]), queue_next_step=bool(m[26]), **extra,
        )

    @classmethod
    def kv_copy(cls, job_id: int, generation: int, src, dst, kind: JobKind = JobKind.KV_COPY) -> "Job":
        """A block job: KV_COPY (device -> device), KV_EXPORT (device -> host slots), KV_IMPORT (slots -> device)."""
        assert kind in TRANSFER_KINDS
        z = np.zeros(0, dtype=np.int32)
        return cls(
            job_id=job_id, generation=generation, kind=kind,
            tokens=z, positions=z, query_start=np.zeros(1, np.int32),
            lane_valid=np.zeros(0, np.uint8), context_lens=z,
            block_tables=np.zeros((0, 0), np.int32), sample=np.zeros(0, np.uint8),
            temperature=np.zeros(0, np.float32), top_p=np.zeros(0, np.float32),
            top_k=z, seed=np.zeros(0, np.uint64), want_logprobs=np.zeros(0, np.uint8),
            src_blocks=_i32(src), dst_blocks=_i32(dst),
        )


_LANE_FIELDS = ("context_lens", "sample", "temperature", "top_p", "top_k", "seed", "want_logprobs")
_FLAT_FIELDS = ("tokens", "positions", "query_start", "lane_valid", *_LANE_FIELDS, "src_blocks", "dst_blocks",
                "draft_lens", "draft_src", "adapter")


# optional result arrays of the lanes that ask for more than the sampled token's logprob (ipc.logprob_wants)
_LOGPROB_ARRAYS = (("top_ids", np.int32), ("top_logprobs", np.float32), ("prompt_logprobs", np.float32),
                   ("prompt_start", np.int32), ("prompt_top_ids", np.int32), ("prompt_top_logprobs", np.float32))


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
    # Whether the chip is kept busy (a gap here is the chip waiting on the host), from the worker's own clock:
    device_start_ns: int = 0  # time.monotonic_ns() when the backend call began (0 = unknown)
    idle_us: int = -1  # the chip's idle time from the end of its previous backend call to this one's start; -1 = first
    masks: int = 0  # constrained lanes the worker masked (structured output)
    mask_us: int = 0  # time it spent computing their masks
    # verification jobs only: accepted draft tokens per lane (tokens[lane] is the token after them), and
    # the accepted drafts' logprobs and tokens, packed lane after lane
    accepted: np.ndarray | None = None  # int32 [B]
    accepted_logprobs: np.ndarray | None = None  # float32 [sum(accepted)]
    accepted_tokens: np.ndarray | None = None  # int32 [sum(accepted)]
    # lanes asking for alternatives (ipc.logprob_wants): the top K of each sampled token, K the job's largest ask
    top_ids: np.ndarray | None = None  # int32 [B, K], -1 padded
    top_logprobs: np.ndarray | None = None  # float32 [B, K]
    # PROMPT lanes: each input token after the lane's first, given the ones before it; lane after lane
    prompt_logprobs: np.ndarray | None = None  # float32 [R]
    prompt_start: np.ndarray | None = None  # int32 [B+1]: lane i's entries are [prompt_start[i], prompt_start[i+1])
    prompt_top_ids: np.ndarray | None = None  # int32 [R, K], -1 padded
    prompt_top_logprobs: np.ndarray | None = None  # float32 [R, K]
    # jobs with imports (Job.imports): uint8 [B], 1 where the lane's import was refused and the lane not run
    # (nothing written for it, tokens[lane] = -1); None = every lane ran
    refused: np.ndarray | None = None

    def to_arrays(self) -> dict[str, np.ndarray]:
        S = ResultMeta
        meta = np.zeros(S.LEN, dtype=np.int64)
        meta[S.JOB_ID] = self.job_id
        meta[S.GENERATION] = self.generation
        meta[S.KIND] = int(self.kind)
        meta[S.STATUS] = int(self.status)
        meta[S.DEVICE_US] = self.device_us
        meta[S.WORKER_US] = self.worker_us
        meta[S.MASKS] = self.masks
        meta[S.MASK_US] = self.mask_us
        meta[S.DEVICE_START_NS] = self.device_start_ns
        meta[S.IDLE_US] = self.idle_us
        out = {
            "meta": meta,
            "tokens": _i32(self.tokens),
            "logprobs": np.ascontiguousarray(self.logprobs, dtype=np.float32),
        }
        if self.logits is not None:
            out["logits"] = np.ascontiguousarray(self.logits, dtype=np.float32)
        if self.accepted is not None:
            out["accepted"] = _i32(self.accepted)
            lps = self.accepted_logprobs
            out["accepted_logprobs"] = np.ascontiguousarray(np.zeros(0) if lps is None else lps, dtype=np.float32)
            if self.accepted_tokens is not None:
                out["accepted_tokens"] = _i32(self.accepted_tokens)
        for name, dt in _LOGPROB_ARRAYS:
            v = getattr(self, name)
            if v is not None:
                out[name] = np.ascontiguousarray(v, dtype=dt)
        if self.refused is not None:
            out["refused"] = np.ascontiguousarray(self.refused, dtype=np.uint8)
        return out

    @classmethod
    def from_arrays(cls, a) -> "JobResult":
        """Build a JobResult from a mapping of arrays (ring views are copied out)."""
        m = a["meta"].tolist()
        S = ResultMeta
        if len(m) <= S.MASK_US:
            raise ValueError(f"result record: a meta of {len(m)} entries, not {S.MASK_US + 1} or more")
        full = len(m) > S.IDLE_US  # an older worker's record has no device_start_ns, idle_us
        logits = a["logits"] if "logits" in a else None
        return cls(
            job_id=m[S.JOB_ID],
            generation=m[S.GENERATION],
            kind=_member(_KIND_OF, JobKind, m[S.KIND]),
            status=_member(_STATUS_OF, JobStatus, m[S.STATUS]),
            device_us=m[S.DEVICE_US],
            worker_us=m[S.WORKER_US],
            device_start_ns=m[S.DEVICE_START_NS] if full else 0,
            idle_us=m[S.IDLE_US] if full else -1,
            masks=m[S.MASKS],
            mask_us=m[S.MASK_US],
            tokens=np.array(a["tokens"]),
            logprobs=np.array(a["logprobs"]),
            logits=None if logits is None else np.array(logits),
            accepted=np.array(a["accepted"]) if "accepted" in a else None,
            accepted_logprobs=np.array(a["accepted_logprobs"]) if "accepted_logprobs" in a else None,
            accepted_tokens=np.array(a["accepted_tokens"]) if "accepted_tokens" in a else None,
            refused=np.array(a["refused"]) if "refused" in a else None,
            **{name: np.array(a[name]) for name, _ in _LOGPROB_ARRAYS if name in a},
        )

    @classmethod
    def failed(cls, job: Job, status: JobStatus = JobStatus.FAILED) -> "JobResult":
        b = job.batch
        return cls(
            job_id=job.job_id, generation=job.generation, kind=job.kind, status=status,
            tokens=np.full(b, -1, np.int32), logprobs=np.zeros(b, np.float32),
        )


class Lane(NamedTuple):
    """One active lane of a job: its new tokens starting at position `start`, and its block table.

    A NamedTuple, not a frozen dataclass: the scheduler builds one per
    generated token, and a frozen dataclass costs twice as much to build.
    """

    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]
    sample: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    want_logprobs: bool = False
    # structured output (see the module docstring): 0 = unconstrained
    constraint: int = 0
    constraint_key: int = 0
    constraint_done: int = 0
    replay: Sequence[int] = ()  # sampling prefill lanes only
    grammar: str = ""  # sampling prefill lanes only
    drafts: int = 0  # the last `drafts` tokens are speculative drafts to verify
    draft_model: bool = False  # the worker's draft model proposes them (the tokens sent are placeholders)
    penalty: LanePenalty | None = None  # sampling penalties (ipc.lane_penalties); None: none


# Lane field positions, for build_job's columns (zip(*lanes))
_TOKENS, _START, _BLOCK_TABLE, _SAMPLE, _TEMPERATURE, _TOP_P, _TOP_K, _SEED, _WANT_LOGPROBS, _CONSTRAINT = range(10)
_DRAFTS, _DRAFT_MODEL = Lane._fields.index("drafts"), Lane._fields.index("draft_model")
_PENALTY = Lane._fields.index("penalty")
assert Lane._fields[:10] == ("tokens", "start", "block_table", "sample", "temperature", "top_p", "top_k", "seed",
                             "want_logprobs", "constraint")
_NO_COLUMNS: tuple = ((),) * len(Lane._fields)


def build_job(kind: JobKind, lanes: Sequence[Lane | None], *, job_id: int = 0, generation: int = 0,
              batch: int | None = None, table_width: int | None = None, return_logits: bool = False,
              decode_steps: int = 1, queue_next_step: bool = False) -> Job:
    """Pack per-lane inputs into a Job; `None` lanes (and lanes past len(lanes) up to `batch`) are inactive.

    The packed layout (query_start offsets, -1 padded block tables,
    context_lens = last position + 1) is easy to get subtly wrong by hand, so
    the scheduler, tools and tests all describe lanes and let this pack them.
    A fixed `table_width` keeps a profile's record size constant.
    """
    assert kind in (JobKind.PREFILL, JobKind.DECODE)
    b = len(lanes) if batch is None else batch
    n_in = len(lanes)
    assert 0 < n_in <= b, "more lanes than the compiled batch"
    # Column by column, one numpy conversion per field: the scheduler builds a job per decode step, so a
    # numpy store per lane and field would be a dozen per generated token.
    gaps = None in lanes
    active = [ln for ln in lanes if ln is not None] if gaps else lanes
    n = len(active)
    cols = tuple(zip(*active)) if n else _NO_COLUMNS  # the Lane fields, each as a tuple over the active lanes
    tables = cols[_BLOCK_TABLE]
    table_lens = [len(t) for t in tables]
    width = table_width if table_width is not None else max(table_lens or [1])
    counts = [len(t) for t in cols[_TOKENS]]
    starts = cols[_START]
    if n:
        assert min(counts) >= 1 and (kind is JobKind.PREFILL or max(counts) == 1)
        assert max(table_lens) <= width, "block table wider than table_width"
    if kind is JobKind.DECODE:
        tokens = np.array([t[0] for t in cols[_TOKENS]], np.int32).reshape(-1)
        positions = np.array(starts, np.int32).reshape(-1)
    else:
        tokens = np.fromiter(itertools.chain.from_iterable(cols[_TOKENS]), np.int32, sum(counts))
        positions = np.concatenate([np.arange(st, st + c, dtype=np.int32) for st, c in zip(starts, counts)]) \
            if n else np.zeros(0, np.int32)
    width = max(width, 1)
    query_start = np.zeros(b + 1, np.int32)
    lane_valid = np.zeros(b, np.uint8)
    context_lens = np.zeros(b, np.int32)
    block_tables = np.full((b, width), -1, np.int32)
    sample = np.zeros(b, np.uint8)
    temperature = np.zeros(b, np.float32)
    top_p = np.ones(b, np.float32)
    top_k = np.zeros(b, np.int32)
    seed = np.zeros(b, np.uint64)
    want_logprobs = np.zeros(b, np.uint8)
    # where the active lanes sit: the first n slots, or (inactive lanes in between) their indices
    at = [i for i, ln in enumerate(lanes) if ln is not None] if gaps else slice(0, n)
    if n:
        if gaps:
            per_lane = [0] * n_in
            for i, c in zip(at, counts):
                per_lane[i] = c
            query_start[1:n_in + 1] = list(itertools.accumulate(per_lane))
        else:
            query_start[1:n + 1] = list(itertools.accumulate(counts))
        query_start[n_in + 1:] = query_start[n_in]
        lane_valid[at] = 1
        context_lens[at] = [st + c for st, c in zip(starts, counts)]
        if gaps:
            rows = np.full((n, width), -1, np.int32)
            _fill_tables(rows, tables, table_lens)
            block_tables[at] = rows
        else:
            _fill_tables(block_tables[:n], tables, table_lens)
        sample[at] = cols[_SAMPLE]
        temperature[at] = cols[_TEMPERATURE]
        top_p[at] = cols[_TOP_P]
        top_k[at] = cols[_TOP_K]
        seed[at] = [x & 0xFFFFFFFFFFFFFFFF for x in cols[_SEED]]
        want_logprobs[at] = cols[_WANT_LOGPROBS]
    draft_lens, draft_src = _EMPTY_I32, _EMPTY_U8
    if n and any(cols[_DRAFTS]):
        draft_lens = np.zeros(b, np.int32)
        draft_src = np.zeros(b, np.uint8) if any(cols[_DRAFT_MODEL]) else _EMPTY_U8
        for i, ln, c in zip(range(n) if not gaps else at, active, counts):
            if ln.drafts:
                assert kind is JobKind.PREFILL and ln.sample and ln.drafts < c
                draft_lens[i] = ln.drafts
                if ln.draft_model:
                    draft_src[i] = 1
    job = Job(
        job_id=job_id, generation=generation, kind=kind, tokens=tokens, positions=positions,
        query_start=query_start, lane_valid=lane_valid, context_lens=context_lens,
        block_tables=block_tables, sample=sample, temperature=temperature, top_p=top_p,
        top_k=top_k, seed=seed, want_logprobs=want_logprobs, return_logits=return_logits,
        decode_steps=decode_steps, draft_lens=draft_lens, draft_src=draft_src, queue_next_step=queue_next_step,
    )
    if n and any(cols[_CONSTRAINT]):
        _add_constraints(job, lanes, b)
    if n and any(p is not None for p in cols[_PENALTY]):
        job.penalties = JobPenalties.build([None if ln is None else ln.penalty for ln in lanes], b)
    return job


def decode_job(tokens: Sequence[int], starts: Sequence[int], tables: Sequence[Sequence[int]],
               sampling: Sequence[tuple], *, job_id: int = 0, generation: int = 0, batch: int | None = None,
               table_width: int | None = None, decode_steps: int = 1, queue_next_step: bool = False) -> Job:
    """A decode job of n sampling, unconstrained lanes in slots 0..n-1 (the rest of `batch` inactive), from
    columns: lane i's input token tokens[i] at position starts[i], its block table tables[i] and its
    sampling[i] = (temperature, top_p, top_k, seed, want_logprobs).

    The Job build_job makes of the same lanes, without a Lane per lane: the scheduler builds one decode
    job per step, and packing columns it already has costs a fraction of building and transposing lanes.
    """
    n = len(tokens)
    b = n if batch is None else batch
    assert 0 < n <= b, "more lanes than the compiled batch"
    assert len(starts) == n and len(tables) == n and len(sampling) == n
    table_lens = [len(t) for t in tables]
    width = table_width if table_width is not None else max(table_lens)
    assert max(table_lens) <= width, "block table wider than table_width"
    width = max(width, 1)
    temps, top_ps, top_ks, seeds, wants = zip(*sampling)
    query_start, lane_valid = _decode_slots(b, n)
    context_lens = np.zeros(b, np.int32)
    context_lens[:n] = starts
    context_lens[:n] += 1
    block_tables = np.full((b, width), -1, np.int32)
    _fill_tables(block_tables[:n], tables, table_lens)
    temperature = np.zeros(b, np.float32)
    temperature[:n] = temps
    top_p = np.ones(b, np.float32)
    top_p[:n] = top_ps
    top_k = np.zeros(b, np.int32)
    top_k[:n] = top_ks
    seed = np.zeros(b, np.uint64)
    try:
        seed[:n] = seeds  # the scheduler's seeds are already in [0, 2**64)
    except OverflowError:
        seed[:n] = [x & 0xFFFFFFFFFFFFFFFF for x in seeds]
    want_logprobs = np.zeros(b, np.uint8)
    want_logprobs[:n] = wants
    return Job(
        job_id=job_id, generation=generation, kind=JobKind.DECODE, tokens=np.array(tokens, np.int32),
        positions=np.array(starts, np.int32), query_start=query_start, lane_valid=lane_valid,
        context_lens=context_lens, block_tables=block_tables, sample=lane_valid, temperature=temperature,
        top_p=top_p, top_k=top_k, seed=seed, want_logprobs=want_logprobs, decode_steps=decode_steps,
        queue_next_step=queue_next_step,
    )


def _fill_tables(rows: np.ndarray, tables: Sequence[Sequence[int]], lens: list[int]) -> None:
    """rows[i, :lens[i]] = tables[i] for every i at once (rows is -1 filled): the flat entries fill each row's
    first len(table) slots in row-major order, within the columns the longest table reaches."""
    m = max(lens) if lens else 0
    if m:
        used = rows[:, :m]
        used[np.arange(m) < np.array(lens)[:, None]] = np.fromiter(itertools.chain.from_iterable(tables),
                                                                    np.int32, sum(lens))


@functools.lru_cache(maxsize=1024)
def _decode_slots(b: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """query_start and lane_valid (= sample) of a decode job with lanes 0..n-1 of b active: shared, read-only."""
    qs = np.minimum(np.arange(b + 1, dtype=np.int32), n)
    valid = np.zeros(b, np.uint8)
    valid[:n] = 1
    qs.flags.writeable = valid.flags.writeable = False
    return qs, valid


def _add_constraints(job: Job, lanes: Sequence[Lane | None], b: int) -> None:
    """Fill the constraint fields of a job that has a constrained lane (the rare path: kept out of build_job)."""
    cid = np.zeros(b, np.uint64)
    key = np.zeros(b, np.uint64)
    done = np.zeros(b, np.int32)
    replay_start = np.zeros(b + 1, np.int32)
    grammar_start = np.zeros(b + 1, np.int32)
    replays: list[Sequence[int]] = []
    grammars: list[bytes] = []
    for i in range(b):
        ln = lanes[i] if i < len(lanes) else None
        n_rep = n_gr = 0
        if ln is not None and ln.constraint:
            cid[i], key[i], done[i] = ln.constraint, ln.constraint_key & 0xFFFFFFFFFFFFFFFF, ln.constraint_done
            if ln.replay:
                replays.append(ln.replay)
                n_rep = len(ln.replay)
            if ln.grammar:
                g = ln.grammar.encode("utf-8")
                grammars.append(g)
                n_gr = len(g)
        replay_start[i + 1] = replay_start[i] + n_rep
        grammar_start[i + 1] = grammar_start[i] + n_gr
    job.constraint_id, job.constraint_key, job.constraint_done = cid, key, done
    job.replay = np.fromiter((t for r in replays for t in r), np.int32, int(replay_start[-1]))
    job.replay_start = replay_start
    job.grammar = np.frombuffer(b"".join(grammars), np.uint8).copy()
    job.grammar_start = grammar_start
