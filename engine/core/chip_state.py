"""What the scheduler tracks per chip: its KV manager, queues and jobs in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.actions import ReleaseBlocks
from engine.core.inflight_governor import InflightGovernor
from engine.core.kv import KvManager
from engine.core.prefill_queues import PrefillQueues, SmoothWeightedRoundRobin
from engine.core.request_record import RequestRecord
from ipc.records import JobKind


@dataclass
class InflightJob:
    job_id: int
    kind: JobKind
    lanes: list[int]  # request ids, lane order
    seq_ids: list[int]
    start_lens: list[int]  # committed_len of each lane before the job
    new_lens: list[int]  # committed_len of each lane after the job
    sampled: list[bool]  # per lane: a token is sampled (decode lanes, a prompt's last chunk)
    batch: int
    submitted_at: float
    timeout_at: float
    steps: int = 1  # decode steps the worker runs before answering (multi-step decode)
    # lanes dropped from this job: their request takes nothing from its output (a queued step whose
    # predecessor was lost)
    dropped: set[int] = field(default_factory=set)
    drafts: list[list[int]] | None = None  # per lane: draft tokens to verify (None: no lane speculates)
    model_drafts: list[bool] | None = None  # per lane: the worker's draft model proposes them (placeholders here)


@dataclass(eq=False)
class ChipState:
    chip: int
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    kv: KvManager
    prefill: PrefillQueues
    wrr: SmoothWeightedRoundRobin
    in_service: bool = True
    inflight: dict[int, InflightJob] = field(default_factory=dict)
    decode_ready: dict[int, None] = field(default_factory=dict)  # ordered set of request ids
    bound: set[int] = field(default_factory=set)  # request ids holding a KV sequence here
    # decode lanes whose job is in flight with no next step queued behind it (executor.queue_next_step)
    queueable: dict[int, None] = field(default_factory=dict)
    governor: InflightGovernor | None = None  # jobs in flight allowed now (ping/pong and its downgrade)
    jobs_submitted: int = 0
    transfers: int = 0  # KV_EXPORT / KV_IMPORT jobs among `inflight` (they take no compute slot)
    faults: int = 0

    @property
    def load(self) -> int:
        return len(self.bound) + len(self.inflight)

    def may_queue_step(self, r: RequestRecord) -> None:
        """r's job is running: its next step may be queued unless that job's token is its last (max_tokens),
        or its output is constrained or penalised (the worker's matcher or counts take its tokens in order,
        job by job)."""
        if r.stop.max_tokens - r.stop.produced > 1 and not r.params.host_stepped:
            self.queueable[r.request_id] = None

    def release_freed(self, out: list) -> None:
        """The blocks freed since the last job, as a notice ahead of any job that may reuse one."""
        freed = self.kv.take_freed()
        if freed:
            out.append(ReleaseBlocks(self.chip, freed))
