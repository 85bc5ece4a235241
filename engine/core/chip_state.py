"""What the scheduler tracks per chip: its KV manager, queues and jobs in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.inflight_governor import InflightGovernor
from engine.core.kv import KvManager
from engine.core.prefill_queues import PrefillQueues, SmoothWeightedRoundRobin
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
    # lanes whose request no longer waits for this job's output (a queued step whose predecessor was lost)
    dropped: set[int] = field(default_factory=set)


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
    followable: dict[int, None] = field(default_factory=dict)
    governor: InflightGovernor | None = None  # jobs in flight allowed now (ping/pong and its downgrade)
    jobs_submitted: int = 0
    transfers: int = 0  # KV_EXPORT / KV_IMPORT jobs among `inflight` (they take no compute slot)
    faults: int = 0

    @property
    def load(self) -> int:
        return len(self.bound) + len(self.inflight)
