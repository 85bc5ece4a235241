"""KV tiers below the device: what the scheduler exports, what it promotes, and the transfer jobs for both.

One `KvTiers` per scheduler (one model generation on a board) holds the host
tier (the board's shared-memory slot pool, shared by every chip) and the disk
tier (block files), both indexed by chain hash (`kv.chain_hash`), so a prefix
computed on chip 0 is found from chip 1 and after a restart.

* Write-through and demotion. Blocks a sequence adds to a chip's prefix
  cache are exported (`write_through`), and a block the device cache evicts
  is exported if no tier has it yet. Both are noted by the KV manager
  (`KvManager.tier_sink`, `PrefixCache.evict_sink`) and become one KV_EXPORT
  job per chip, which the scheduler queues before any other job of that chip
  (`flush`): the worker runs jobs in ring order, so the export reads the
  blocks before any later job can overwrite one.
* Promotion. At reserve, the blocks of the prompt after the device hit are
  looked up in the host, then the disk tier; a run of hits that pays
  (`TierPolicy`) becomes a KV_IMPORT job into the sequence's fresh blocks,
  and the sequence is UPDATING until it completes. The prefill then starts
  after the imported tokens. A refused import (corrupt, truncated, missing,
  other layout) wrote nothing: the sequence goes back to ACTIVE, those tier
  entries are dropped, and the tokens are recomputed.
* Promotion in the prefill job. When the workers run imports carried in a
  prefill job (`ipc.lane_imports`), the plan rides in the job of the
  prompt's first chunk instead (`lane_import`): no round trip of its own.
  The worker refuses a lane whose import is bad and runs the others; the
  refused lane's tier entries are dropped and its prompt is recomputed
  (`lane_import_done`).

Transfer jobs encode, besides src/dst blocks: tokens = the blocks' chain
hashes (4 int32 words each) and positions = where each block goes or comes
from (`HOST`, `DISK`, or both for an export).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.core.kv.chain_hash import DIGEST, chain_of, extend_chain, root_hash
from engine.core.kv.manager import KvManager
from engine.core.kv.tier_index import EntryState, TierEntry, TierIndex
from engine.core.kv.tier_policy import PromoteMode, TierPolicy
from ipc.lane_imports import LaneImports
from ipc.records import Job, JobKind

HOST = 1
DISK = 2
# upper bounds (seconds) of the transfer-time histogram buckets; the last is +Inf
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass
class _Transfer:
    kind: JobKind
    chip: int
    blocks: int
    host: list[TierEntry]
    disk: list[TierEntry]
    submitted_at: float


@dataclass
class ImportPlan:
    """A run of tier hits after the device hit: promoted into the sequence's next `len(chains)` blocks."""

    chains: list[bytes]
    src: list[int]  # host slot, or -1 (disk)
    where: list[int]  # HOST or DISK per block
    host: list[TierEntry]
    disk: list[TierEntry]

    @property
    def blocks(self) -> int:
        return len(self.chains)


def chain_words(chains: Sequence[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(chains), "<i4").copy() if chains else np.zeros(0, np.int32)


def words_chains(words: np.ndarray) -> list[bytes]:
    raw = np.ascontiguousarray(words, "<i4").tobytes()
    return [raw[i:i + DIGEST] for i in range(0, len(raw), DIGEST)]


@dataclass
class TierStats:
    hist: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_BUCKETS) + 1))
    seconds_sum: float = 0.0


class KvTiers:
    def __init__(self, model_tag: str, block_size: int, *, host_slots: int = 0, disk_blocks: int = 0,
                 block_bytes: int = 0, policy: TierPolicy = TierPolicy(), write_through: bool = True) -> None:
        if host_slots <= 0 and disk_blocks <= 0:
            raise ValueError("KvTiers needs a host or a disk tier")
        self.model_tag = model_tag
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.policy = policy
        self.write_through = write_through
        self.host = TierIndex("host", host_slots, slotted=True) if host_slots > 0 else None
        self.disk = TierIndex("disk", disk_blocks, slotted=False) if disk_blocks > 0 else None
        # Exports only pay when a hit can ever be promoted (stub: recomputing costs nothing).
        self.exporting = policy.mode is PromoteMode.ALWAYS or (
            policy.mode is PromoteMode.COST and policy.cost.break_even_blocks(block_size) is not None)
        self._roots: dict[str, bytes] = {}
        self._exports: dict[int, list[tuple[int, bytes, TierEntry | None, TierEntry | None]]] = {}
        self._jobs: dict[int, _Transfer] = {}
        self._lane_jobs: dict[int, dict[int, _Transfer]] = {}  # prefill job id -> lane's request id -> its import
        self.counters: Counter[str] = Counter()
        self.times = {JobKind.KV_EXPORT: TierStats(), JobKind.KV_IMPORT: TierStats()}

    def attach(self, kv: KvManager) -> None:
        kv.tier_sink = []
        kv.cache.evict_sink = []

    def root(self, salt: str) -> bytes:
        r = self._roots.get(salt)
        if r is None:
            r = self._roots[salt] = root_hash(self.model_tag, salt)
        return r

    def is_transfer(self, job_id: int) -> bool:
        return job_id in self._jobs

    def has_lane_imports(self, job_id: int) -> bool:
        return job_id in self._lane_jobs

    # -- exports ---------------------------------------------------------------------
    def collect(self, chip: int, kv: KvManager) -> None:
        """Turn the KV manager's notes (new cached blocks, evicted blocks) into exports queued for `chip`."""
        bs = self.block_size
        sink = kv.tier_sink
        if sink:
            for seq, tokens, first, end, blocks in sink:
                if seq.chain is None:
                    seq.chain = []
                extend_chain(seq.chain, self.root(seq.key.salt), tokens, bs, end)
                if self.write_through:
                    for i in range(first, end):
                        self._queue_export(chip, seq.chain[i], blocks[i - first], "write_through")
            sink.clear()
        evicted = kv.cache.evict_sink
        if evicted:
            for key, tokens, block in evicted:
                self._queue_export(chip, chain_of(self.root(key.salt), tokens, bs)[-1], block, "demoted")
            evicted.clear()

    def _queue_export(self, chip: int, chain: bytes, block: int, why: str) -> None:
        if not self.exporting:
            return
        h = self.host.claim(chain) if self.host is not None else None
        d = None
        if self.disk is not None:
            d = self.disk.claim(chain)
        if h is None and d is None:
            return
        self.counters[f"export_{why}_blocks"] += 1
        self._exports.setdefault(chip, []).append((block, chain, h, d))

    def export_job(self, chip: int, job_id: int, generation: int, now: float) -> Job | None:
        """The KV_EXPORT job of what `collect` queued for `chip` (None: nothing queued)."""
        queued = self._exports.pop(chip, None)
        if not queued:
            return None
        src = [b for b, _, _, _ in queued]
        dst = [-1 if h is None else h.slot for _, _, h, _ in queued]
        where = [(HOST if h is not None else 0) | (DISK if d is not None else 0) for _, _, h, d in queued]
        job = Job.kv_copy(job_id, generation, src, dst, kind=JobKind.KV_EXPORT)
        job.tokens = chain_words([c for _, c, _, _ in queued])
        job.positions = np.asarray(where, np.int32)
        self._jobs[job_id] = _Transfer(JobKind.KV_EXPORT, chip, len(queued), [h for *_, h, _ in queued if h],
                                       [d for *_, d in queued if d], now)
        self.counters["export_jobs"] += 1
        return job

    # -- promotion ---------------------------------------------------------------------
    def plan_import(self, salt: str, tokens: Sequence[int], device_blocks: int) -> ImportPlan | None:
        """The tier hits of `tokens[:-1]` after its first `device_blocks` (already on the chip), pinned; or None."""
        bs = self.block_size
        n_full = (len(tokens) - 1) // bs
        if n_full <= device_blocks:
            return None
        chains = chain_of(self.root(salt), tokens[:n_full * bs], bs)[device_blocks:]
        plan = ImportPlan([], [], [], [], [])
        for c in chains:
            h = self.host.entry(c) if self.host is not None else None
            if h is not None and h.state is EntryState.READY:
                plan.chains.append(c)
                plan.src.append(h.slot)
                plan.where.append(HOST)
                plan.host.append(h)
                continue
            d = self.disk.entry(c) if self.disk is not None else None
            if d is not None and d.state is EntryState.READY:
                plan.chains.append(c)
                plan.src.append(-1)
                plan.where.append(DISK)
                plan.disk.append(d)
                continue
            pending = (h is not None and h.state is EntryState.PENDING) or d is not None
            self.counters["miss_pending" if pending else "miss_absent"] += 1
            break
        if not plan.chains:
            return None
        if not self.policy.worth_promoting(plan.blocks, bs):
            self.counters["miss_not_worth"] += 1
            return None
        if self.host is not None:
            self.host.pin(e.chain for e in plan.host)
        if self.disk is not None:
            self.disk.pin(e.chain for e in plan.disk)
        return plan

    def import_job(self, chip: int, job_id: int, generation: int, plan: ImportPlan, dst: Sequence[int],
                   now: float) -> Job:
        assert len(dst) == plan.blocks
        job = Job.kv_copy(job_id, generation, plan.src, dst, kind=JobKind.KV_IMPORT)
        job.tokens = chain_words(plan.chains)
        job.positions = np.asarray(plan.where, np.int32)
        self._jobs[job_id] = _Transfer(JobKind.KV_IMPORT, chip, plan.blocks, plan.host, plan.disk, now)
        self.counters["import_jobs"] += 1
        self.counters["hit_host_blocks"] += len(plan.host)
        self.counters["hit_disk_blocks"] += len(plan.disk)
        return job

    def lane_import(self, chip: int, job_id: int, rid: int, lane: int, plan: ImportPlan, dst: Sequence[int],
                    now: float) -> LaneImports:
        """The plan as imports of lane `lane` (request `rid`) of prefill job `job_id`, into device blocks `dst`."""
        assert len(dst) == plan.blocks
        self._lane_jobs.setdefault(job_id, {})[rid] = _Transfer(JobKind.KV_IMPORT, chip, plan.blocks, plan.host,
                                                               plan.disk, now)
        self.counters["import_lanes"] += 1
        self.counters["hit_host_blocks"] += len(plan.host)
        self.counters["hit_disk_blocks"] += len(plan.disk)
        return LaneImports.build([lane] * plan.blocks, plan.src, dst, plan.where, chain_words(plan.chains))

    def drop_plan(self, plan: ImportPlan) -> None:
        """A plan that never went out (its request ended or was preempted first): its entries are unpinned."""
        self._unpin(plan.host, plan.disk)

    def lane_import_done(self, job_id: int, rid: int, ok: bool, refused: bool, now: float) -> None:
        """The import of one lane of a prefill job ended (as `job_done` for a KV_IMPORT job)."""
        lanes = self._lane_jobs.get(job_id)
        t = None if lanes is None else lanes.pop(rid, None)
        if lanes is not None and not lanes:
            del self._lane_jobs[job_id]
        if t is not None:  # not timed: the job's time is its prefill's as much as the import's
            self._import_done(t, ok, refused, now, timed=False)

    # -- results -------------------------------------------------------------------------
    def job_done(self, job_id: int, ok: bool, refused: bool, now: float) -> _Transfer | None:
        """A transfer job ended (ok, refused = the worker rejected its records, or lost when neither)."""
        t = self._jobs.pop(job_id, None)
        if t is None:
            for lane in self._lane_jobs.pop(job_id, {}).values():  # a prefill job carrying imports, lost
                self._import_done(lane, False, False, now)
            return None
        if t.kind is JobKind.KV_IMPORT:
            self._import_done(t, ok, refused, now)
            return t
        assert t.kind is JobKind.KV_EXPORT
        if ok:
            self._moved(t, now)
        for tier, entries in ((self.host, t.host), (self.disk, t.disk)):
            for e in entries:
                tier.filled(e, ok)
        self.counters["exported_blocks" if ok else "export_failed_blocks"] += t.blocks
        return t

    def _moved(self, t: _Transfer, now: float, timed: bool = True) -> None:
        """A transfer's bytes counted, and its time from submission (`timed`: its job was the transfer alone)."""
        self.counters["bytes_moved"] += t.blocks * self.block_bytes
        if timed:
            st = self.times[t.kind]
            dt = max(0.0, now - t.submitted_at)
            st.hist[bisect.bisect_left(TRANSFER_BUCKETS, dt)] += 1
            st.seconds_sum += dt

    def _unpin(self, host: Sequence[TierEntry], disk: Sequence[TierEntry]) -> None:
        if self.host is not None:
            self.host.unpin(host)
        if self.disk is not None:
            self.disk.unpin(disk)

    def _import_done(self, t: _Transfer, ok: bool, refused: bool, now: float, timed: bool = True) -> None:
        if ok:
            self._moved(t, now, timed)
        self._unpin(t.host, t.disk)
        if ok:
            self.counters["promoted_blocks"] += t.blocks
        elif refused:
            # One record in the job was bad (the worker's log names the cause): drop them all, recompute.
            self.counters["miss_refused"] += 1
            for tier, entries in ((self.host, t.host), (self.disk, t.disk)):
                for e in entries:
                    tier.drop(e)
        else:
            self.counters["import_failed"] += 1

    def chip_down(self, chip: int, job_ids: Sequence[int], now: float) -> None:
        """The chip's worker died: its transfers in flight are lost, what it had queued is dropped."""
        for job_id in job_ids:
            self.job_done(job_id, False, False, now)
        for _, _, h, d in self._exports.pop(chip, []):
            if h is not None:
                self.host.filled(h, False)
            if d is not None:
                self.disk.filled(d, False)

    def take_disk_deletes(self) -> list[bytes]:
        """Chains whose disk files the shell unlinks (evicted past `kv.disk_max_gb`, refused, failed)."""
        return self.disk.take_evicted() if self.disk is not None else []

    # -- persistence ---------------------------------------------------------------------
    def disk_chains(self) -> list[bytes]:
        return self.disk.chains() if self.disk is not None else []

    def restore_disk(self, chains: Sequence[bytes]) -> int:
        """Index block files a previous run left (oldest first); returns how many were taken."""
        if self.disk is None:
            return 0
        n = sum(1 for c in chains if self.disk.adopt(c) is not None)
        self.counters["disk_restored_blocks"] += n
        return n

    # -- stats -------------------------------------------------------------------------
    def stats(self) -> dict:
        out: dict = {"counters": dict(self.counters), "block_bytes": self.block_bytes,
                     "write_through": self.write_through, "policy": self.policy.mode.value}
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is None:
                continue
            ready = tier.ready_count()
            out[name] = {"capacity_blocks": tier.capacity, "blocks": ready, "pending": tier.pending_count(),
                         "bytes": ready * self.block_bytes, "counters": dict(tier.counters)}
        out["transfer_seconds"] = {
            k.name.lower(): {"buckets": list(TRANSFER_BUCKETS), "counts": list(v.hist), "sum": v.seconds_sum}
            for k, v in self.times.items()}
        return out
