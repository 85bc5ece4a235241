"""The `llamacpp` backend: llama.cpp as the chip runtime of a CPU "chip".

One llama.cpp model and context per worker process. The scheduler keeps its
paged-KV view (block ids, block tables) and stays the authority for
admission; llama.cpp keeps the real KV in one unified cell pool of exactly
`num_blocks * block_size` cells, organised in sequences. This module maps
the one onto the other from the jobs themselves, plus the scheduler's
release notices (`release_blocks`):

* Each llama.cpp sequence id remembers the npuserve block ids that hold its
  positions. A lane of a job names its block table and its first new
  position p0; the sequence that holds blocks `table[:ceil(p0/bs)]` for
  positions `[0, p0)` holds exactly the KV the scheduler means.
* Continuing a sequence appends to it. A prefix-cache hit (the prefix is
  held by another sequence) copies the prefix's cells into a fresh sequence
  id (`llama_memory_seq_cp`: the cells are shared, not duplicated). A lane
  that restarts inside its own last partial block (a retry) truncates it
  (`llama_memory_seq_rm` of the tail).
* When a job writes into a block, that block was just handed to the lane,
  so any other sequence still holding it is stale from there on (released,
  preempted or cancelled by the scheduler): its cells from that block on
  are removed. So llama.cpp holds at most one cell per npuserve KV slot and
  can never run out of cells while the scheduler believes blocks are free.
* A released block (freed by the scheduler, not kept in its prefix cache)
  has its cells removed at once. Besides the memory, this matters for the
  results: llama.cpp places new cells in the lowest free cells once enough
  are free below its head, so a sequence's later positions can land in
  cells *before* its earlier ones, and its attention then visits its cells
  in another order than a sequence run alone. On Gemma 3 270M (Q4_K_M)
  that alone moves logits by up to ~1.3 (bits differ, and the quantized
  matmuls amplify it), enough to flip greedy tokens. Freeing finished
  requests' cells promptly keeps the pool compact, so an idle worker's
  next requests start on an empty pool, laid out as when run alone.

A decode job is one `llama_decode` over all valid lanes; a prefill job is
one `llama_decode` over its lanes' tokens: one prompt (chunked when the
scheduler chunks), or, in a mixed batch, several prompts' chunks beside
decode lanes of one token each, as llama.cpp's own server batches them.
Sampling stays npuserve's (the worker samples the logits returned here).
Block copies are not supported, but for a fork (`copy_blocks`: a run of one
sequence's blocks into a new sequence, its cells shared). KV export / import (the host and disk
tiers) moves whole blocks as llama.cpp per-sequence state
(`workers.llamacpp.kv_blocks`); an imported run from position 0 is a
sequence of its own, one that continues a device prefix joins it when a
lane names both; a row that is not the next whole block is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from ipc.records import Job, JobKind
from workers.backends.base import (BackendError, BackendInfo, BatchProfile, KvLayout, KvTransferCost, OneStepBackend,
                                   StepOutput)
from workers.logprob_alternatives import prompt_rows

SUPPORTS = {"prefix_reuse": True, "truncate": True, "chunked_prefill": True, "copy_blocks": False, "swap": True,
            "fork_blocks": True}

# The tier policy's cost model (promote a prefix when its import is expected to beat recomputing it), from
# `npuserve bench-kv-transfer --backend llamacpp` on Gemma 3 270M Q4_K_M, block size 16, 1 thread, a loaded
# 2-core machine (docs/results/2026-12-01-2330-kv-llamacpp.md): an import job of n blocks took ~0.3 ms +
# ~1.2 ms a block, a prefill ~14 ms a token. The prefill figure is taken ~3x faster than measured (more
# threads, an idle machine): promotion still wins from the first whole block.
TRANSFER_COST = KvTransferCost(base_s=5e-4, per_block_s=1.5e-3, prefill_s_per_token=5e-3)
LORA_SLOTS = 8  # LoRA adapters loaded on the model at once (llama.cpp keeps them in host memory)


@dataclass
class _Seq:
    sid: int
    blocks: list[int] = field(default_factory=list)  # block ids covering positions [0, length)
    length: int = 0
    used: int = 0  # job counter at last use (LRU eviction of stale sequences)


@dataclass
class _Run:
    """Imported blocks that continue a prefix the device holds (blocks [start, start + len) of some table):
    their cells wait in sequence `sid` until a lane names the device blocks before them (`_join_run`)."""

    sid: int
    start: int
    blocks: list[int]
    used: int = 0


MAX_RUNS = 8  # imported runs waiting for their lane; the oldest is dropped beyond this


def default_threads(chips: int = 1) -> int:
    """The machine's cores split over the chip workers (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, chips))


class LlamacppBackend(OneStepBackend):
    name = "llamacpp"
    holds_thread_in_calls = True  # a llama_decode can take seconds: the worker heartbeats from a thread

    def __init__(self, *, num_blocks: int | None = None, block_size: int | None = None, chip_id: int = 0,
                 threads: int = 0, chips: int = 1, max_sequences: int = 0, n_ubatch: int = 512) -> None:
        if num_blocks is not None and num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if block_size is not None and block_size <= 0:
            raise ValueError("block_size must be positive")
        if threads < 0 or max_sequences < 0 or n_ubatch <= 0:
            raise ValueError("threads and max_sequences must be >= 0, n_ubatch > 0")
        self._num_blocks, self._block_size = num_blocks, block_size
        self.chip_id = chip_id
        self.threads = threads or default_threads(chips)
        self._max_sequences = max_sequences
        self._n_ubatch = n_ubatch
        self.package = None
        self.model = None
        self._adapters: dict[int, int] = {}  # device slot -> llama_adapter_lora pointer

    # ---- lifecycle -----------------------------------------------------------------

    def load(self, package) -> None:
        """Load a GGUF package (a `GgufPackage`, its path, or None for the tiny model as GGUF)."""
        from workers.gguf_package import GgufPackage
        from workers.llamacpp.binding import LlamaModel, LlamaCppUnavailable
        from workers.llamacpp.kv_blocks import KvBlockIo
        from workers.package_loader import load_package

        if package is None:
            from workers.default_package import ensure_default_gguf_package

            package = ensure_default_gguf_package()
        if isinstance(package, str):
            package = load_package(package)
        if not isinstance(package, GgufPackage):
            raise BackendError(f"llamacpp backend: {getattr(package, 'path', package)} is not a GGUF package "
                               f"(make one with `npuserve import-gguf` or `npuserve make-model --format gguf`)")
        bs = self._block_size or package.block_size
        nb = self._num_blocks or package.kv_num_blocks
        n_seq = self._max_sequences or min(256, max(64, 4 * max(package.profiles)))
        n_batch = max(package.max_seq, 512)
        try:
            model = LlamaModel(package.gguf_path, n_ctx=nb * bs, n_batch=n_batch, n_ubatch=min(self._n_ubatch, n_batch),
                               n_seq_max=n_seq, n_threads=self.threads)
        except LlamaCppUnavailable as e:
            raise BackendError(f"llamacpp backend: {e}") from e
        if model.n_vocab != package.vocab_size:
            model.close()
            raise BackendError(f"llamacpp backend: {package.gguf_path} has {model.n_vocab} tokens, "
                               f"the manifest says {package.vocab_size}")
        if model.info["n_ctx"] < nb * bs:
            model.close()
            raise BackendError(f"llamacpp backend: llama.cpp gave {model.info['n_ctx']} KV cells, need {nb * bs}")
        key_length = model.meta(f"{package.architecture}.attention.key_length")  # Gemma: not n_embd / n_head
        self._head_dim = int(key_length) if key_length and key_length.isdigit() else \
            model.info["n_embd"] // max(1, model.info["n_head"])
        self.unload()
        self.package, self.model = package, model
        self.block_size, self.num_blocks, self.n_seq_max = bs, nb, model.info["n_seq_max"]
        self._limits = SimpleNamespace(vocab_size=package.vocab_size, max_seq=package.max_seq, block_size=bs,
                                       num_blocks=nb)
        self._reset_maps()
        self._kv_io = KvBlockIo(model, bs, scratch=self.n_seq_max - 1, bos=max(0, package.bos_id))
        self._out = np.zeros((max(package.profiles), model.n_vocab), np.float32)

    def _reset_maps(self) -> None:
        self._seqs: dict[int, _Seq] = {}
        # the last sequence id is the scratch of KV export / import (workers.llamacpp.kv_blocks)
        self._free: list[int] = list(range(self.n_seq_max - 2, -1, -1))
        self._holders: dict[int, set[int]] = {}
        self._runs: dict[int, _Run] = {}
        self._clock = 0

    def unload(self) -> None:
        if self.model is not None:
            self.model.close()  # frees its adapters too
        self.package = self.model = None
        self._adapters = {}

    # ---- LoRA adapters: llama.cpp's LoRA GGUF, one adapter set per context (so per job) ----------------

    def read_adapter(self, path: str, sha256: str) -> str:
        """The adapter's GGUF path, after checking it fits the loaded model (PackageError names the mismatch)."""
        from workers.lora.adapter_package import read_adapter_facts
        from workers.lora.gguf_adapter import GGUF_ADAPTER_FILE, check_gguf_against_base
        from workers.package_manifest import PackageError

        pkg, _ = self._loaded()
        facts = read_adapter_facts(path)
        if sha256 and facts.sha256 != sha256:
            raise PackageError(f"{path}: manifest.json changed since the adapter was verified (sha256 differs)")
        if facts.format != "gguf":
            raise PackageError(f"{path}: the llamacpp backend takes LoRA GGUF adapters, not {facts.format}")
        check_gguf_against_base(facts, pkg.gguf_path)
        return os.path.join(facts.path, GGUF_ADAPTER_FILE)

    def load_adapter(self, slot: int, host_adapter: str) -> None:
        from workers.llamacpp.binding import LlamaCppUnavailable

        _, model = self._loaded()
        if not 0 <= slot < LORA_SLOTS:
            raise BackendError(f"llamacpp backend: adapter slot {slot} outside 0..{LORA_SLOTS - 1}")
        self.unload_adapter(slot)
        try:
            self._adapters[slot] = model.lora_load(host_adapter)
        except LlamaCppUnavailable as e:
            raise BackendError(f"llamacpp backend: {e}") from e

    def unload_adapter(self, slot: int) -> None:
        ptr = self._adapters.pop(slot, None)
        if ptr is not None and self.model is not None:
            self.model.lora_set(None)  # it may be the context's current adapter
            self.model.lora_free(ptr)

    def _job_adapter(self, job: Job, lanes: np.ndarray):
        """The one adapter (pointer, or None for the base) every valid lane of the job runs under."""
        if not job.adapter.size:
            return None
        used = set(job.adapter[lanes].tolist())
        if len(used) > 1:
            raise ValueError(f"job {job.job_id}: llama.cpp applies one adapter set per context, the lanes name "
                             f"{sorted(used)}")
        slot = used.pop() if used else -1
        if slot < 0:
            return None
        if slot not in self._adapters:
            raise ValueError(f"adapter slot {slot} holds no adapter")
        return self._adapters[slot]

    def _loaded(self):
        if self.model is None:
            raise BackendError("llamacpp backend: no model loaded")
        return self.package, self.model

    def describe(self) -> BackendInfo:
        pkg, model = self._loaded()
        info = model.info
        head_dim = self._head_dim
        return BackendInfo(
            name=self.name,
            vocab_size=pkg.vocab_size,
            eos_ids=tuple(pkg.eos_ids),
            max_seq=pkg.max_seq,
            profiles=tuple(BatchProfile(b) for b in sorted(pkg.profiles)),
            kv=KvLayout(block_size=self.block_size, num_blocks=self.num_blocks, num_layers=info["n_layer"],
                        num_kv_heads=info["n_head_kv"], head_dim=head_dim, dtype="float16",
                        bytes_per_token=self._kv_io.bytes_per_token),  # a host row: llama.cpp's sequence state
            chunked_prefill=True,
            model_sha256=pkg.sha256,
            mixed_batch_tokens=info["n_batch"],  # one llama_decode takes any mix of sequences and lengths
            kv_transfer=TRANSFER_COST,
            extra={"chip_id": self.chip_id, "package": pkg.path, "model_name": pkg.name,
                   "architecture": pkg.architecture, "bos_id": pkg.bos_id, "pad_id": pkg.pad_id,
                   "threads": self.threads, "n_seq_max": self.n_seq_max, "kv_cells": info["n_ctx"],
                   "supports": dict(SUPPORTS), "tokenizer": dict(pkg.tokenizer), "spec_verify": True,
                   "prompt_logprobs": True,
                   # LoRA GGUF adapters, one per job (llama.cpp sets adapters per context)
                   "lora": {"slots": LORA_SLOTS, "mixed": False}},
        )

    def health(self) -> dict:
        return {"ok": self.model is not None, "backend": self.name, "chip_id": self.chip_id,
                "model_sha256": self.package.sha256 if self.package else "",
                "sequences": len(self._seqs) if self.model is not None else 0}

    # ---- compute -------------------------------------------------------------------

    def _run(self, job: Job) -> StepOutput:
        from workers.backends.ref import RefBackend

        _, model = self._loaded()
        lanes = RefBackend._validate(job, self._limits, self._limits)  # the same checks as the oracle
        adapter = self._job_adapter(job, lanes)  # ValueError (nothing written) for a mixed or empty slot
        model.lora_set(adapter)  # llama.cpp changes nothing when it is the context's current set
        b = job.batch
        if self._out.shape[0] < b:
            self._out = np.zeros((b, model.n_vocab), np.float32)
        logits = self._out[:b]
        if len(lanes) == 0:
            logits[:] = 0
            return StepOutput(logits=logits)
        self._clock += 1
        bs = self.block_size
        lane_list = lanes.tolist()
        plans = []  # (lane, seq, p0, ctx, table)
        busy: set[int] = set()
        for lane in lane_list:
            ctx = int(job.context_lens[lane])
            p0 = ctx - int(job.query_start[lane + 1] - job.query_start[lane])
            need = -(-ctx // bs)
            table = job.block_tables[lane, :need].tolist()
            seq = self._resolve(lane, table, p0, busy)
            busy.add(seq.sid)
            plans.append((lane, seq, p0, ctx, table))
        for lane, seq, p0, ctx, table in plans:
            self._claim(seq, table, p0, ctx)
        # one llama_decode over every valid lane's new tokens
        qs = job.query_start
        counts = [int(qs[lane + 1] - qs[lane]) for lane in lane_list]
        rows = np.concatenate([np.arange(qs[lane], qs[lane + 1]) for lane in lane_list]) if job.kind == JobKind.PREFILL \
            else qs[lanes].astype(np.int64)
        seq_ids = np.repeat(np.array([p[1].sid for p in plans], np.int32), counts)
        want = np.zeros(len(rows), np.int8)
        out_rows = np.zeros(len(rows), np.int32)
        last = np.cumsum(counts) - 1
        emit = (job.sample[lanes] != 0) | bool(job.return_logits)
        want[last[emit]] = 1
        out_rows[last] = lanes
        # verification: the draft rows' logits too, in rows b.. of the output (spec_verify.draft_rows order)
        n_draft = self._want_draft_rows(job, lane_list, counts, want, out_rows, b)
        n_prompt = self._want_prompt_rows(job, rows, want, out_rows, b + n_draft)
        logits = self._out[:b]  # _want_draft_rows / _want_prompt_rows may have grown the buffer
        # Every lane valid and wanting logits (decode steps, mixed jobs of whole prompts): the logits are
        # read where llama.cpp wrote them, lane i in row i, instead of copied (a MB per lane on Gemma).
        in_place = len(lane_list) == b and bool(emit.all()) and not n_draft and not n_prompt
        if in_place:
            rc, view = model.decode_in_place(job.tokens[rows], job.positions[rows], seq_ids, want)
        else:
            rc, _ = model.decode(job.tokens[rows], job.positions[rows], seq_ids, want, out_rows, self._out)
        if rc != 0:
            for _, seq, p0, _, _ in plans:  # the new cells are in an unknown state: forget them
                self._truncate(seq, p0)
            raise BackendError(f"llamacpp backend: llama_decode returned {rc}")
        for _, seq, _, ctx, _ in plans:
            seq.length = ctx
        if in_place:
            return StepOutput(logits=view)
        quiet = np.ones(b, bool)
        quiet[lanes[emit]] = False
        if quiet.any():
            logits[quiet] = 0
        return StepOutput(logits=logits, draft_logits=self._out[b:b + n_draft] if n_draft else None,
                          prompt_logits=self._out[b + n_draft:b + n_draft + n_prompt] if n_prompt else None)

    def _want_prompt_rows(self, job: Job, rows: np.ndarray, want: np.ndarray, out_rows: np.ndarray, at: int) -> int:
        """Ask for the logits of the rows prompt logprobs need (`prompt_rows`), into output rows at, at+1, ...;
        returns how many. Only the lanes that ask pay: llama.cpp computes the output rows it is asked for."""
        wanted = prompt_rows(job)
        if not wanted.size:
            return 0
        where = np.searchsorted(rows, wanted)  # rows: the job's token indices in batch order (ascending)
        want[where] = 1
        out_rows[where] = np.arange(at, at + wanted.size)
        if self._out.shape[0] < at + wanted.size:
            grown = np.zeros((at + wanted.size, self._out.shape[1]), np.float32)
            grown[:self._out.shape[0]] = self._out
            self._out = grown
        return int(wanted.size)

    def _want_draft_rows(self, job: Job, lane_list: list[int], counts: list[int], want: np.ndarray,
                         out_rows: np.ndarray, b: int) -> int:
        """Ask for the logits of each lane's draft rows (output rows b, b+1, ...); returns how many.

        The rejected drafts' cells are rolled back by the lane's next job: it starts at the accepted
        length, and `_resolve` cuts the lane's own sequence there (`llama_memory_seq_rm`) before it runs.
        """
        dl = job.draft_lens
        if not dl.size or not dl.any():
            return 0
        at, k = 0, b
        for lane, n in zip(lane_list, counts):
            d = int(dl[lane])
            if d:
                want[at + n - 1 - d:at + n - 1] = 1
                out_rows[at + n - 1 - d:at + n - 1] = np.arange(k, k + d)
                k += d
            at += n
        if self._out.shape[0] < k:
            self._out = np.zeros((k, self._out.shape[1]), np.float32)
        return k - b

    # ---- the block-table <-> sequence map --------------------------------------------

    def _resolve(self, lane: int, table: list[int], p0: int, busy: set[int]) -> _Seq:
        """The sequence that holds this lane's positions [0, p0), made ready to take position p0."""
        bs = self.block_size
        if p0 == 0:
            return self._new_seq(busy)
        n = -(-p0 // bs)
        best = None
        for sid in self._holders.get(table[n - 1], ()):
            s = self._seqs[sid]
            if s.length >= p0 and s.blocks[:n] == table[:n]:
                if s.length == p0 and sid not in busy:
                    s.used = self._clock
                    return s  # the lane's own sequence, continued
                best = s
        if best is None and self._join_run(table, p0, busy) is not None:
            return self._resolve(lane, table, p0, busy)
        if best is None:
            raise BackendError(f"llamacpp backend: lane {lane}: the KV of positions 0..{p0 - 1} is not on this chip "
                               f"(never written, or evicted); the request must be recomputed")
        best.used = self._clock
        if p0 % bs == 0 and best.sid not in busy and len(best.blocks) > n and len(table) > n \
                and best.blocks[n] == table[n]:
            self._truncate(best, p0)  # the lane's own sequence past rejected drafts: roll its tail back
            return best
        if p0 % bs and best.sid not in busy:
            self._truncate(best, p0)  # a retry inside the lane's own partial block
            return best
        if p0 % bs:
            raise BackendError(f"llamacpp backend: lane {lane}: partial block {table[n - 1]} used by two lanes")
        seq = self._new_seq(busy | {best.sid})
        self.model.seq_cp(best.sid, seq.sid, 0, p0)  # prefix reuse: cells are shared, not copied
        seq.blocks, seq.length = table[:n], p0
        for blk in seq.blocks:
            self._holders.setdefault(blk, set()).add(seq.sid)
        return seq

    def _claim(self, seq: _Seq, table: list[int], p0: int, ctx: int) -> None:
        """Record that `seq` writes positions [p0, ctx): blocks it newly enters are its own from now on."""
        bs = self.block_size
        for k in range(p0 // bs, len(table)):
            blk = table[k]
            if k < len(seq.blocks):
                if seq.blocks[k] != blk:
                    raise BackendError(f"llamacpp backend: block {blk} replaces {seq.blocks[k]} inside a sequence")
                continue
            self._drop_runs_with(blk)
            for other in list(self._holders.get(blk, ())):
                if other != seq.sid:
                    o = self._seqs[other]
                    self._truncate(o, o.blocks.index(blk) * bs)
            seq.blocks.append(blk)
            self._holders.setdefault(blk, set()).add(seq.sid)

    def _truncate(self, seq: _Seq, p: int) -> None:
        """Remove the sequence's positions >= p (the whole sequence when p is 0)."""
        bs = self.block_size
        keep = -(-p // bs)
        for blk in seq.blocks[keep:]:
            holders = self._holders.get(blk)
            if holders is not None:
                holders.discard(seq.sid)
                if not holders:
                    del self._holders[blk]
        seq.blocks = seq.blocks[:keep]
        seq.length = min(seq.length, p)
        if p == 0:
            self.model.seq_rm(seq.sid, -1, -1)
            del self._seqs[seq.sid]
            self._free.append(seq.sid)
        elif not self.model.seq_rm(seq.sid, p, -1):
            raise BackendError(f"llamacpp backend: llama.cpp cannot cut sequence {seq.sid} at {p}")

    def _new_seq(self, busy: set[int]) -> _Seq:
        sid = self._take_sid(busy)
        seq = _Seq(sid, used=self._clock)
        self._seqs[sid] = seq
        return seq

    def _take_sid(self, busy: set[int]) -> int:
        if not self._free and self._runs:
            self._drop_run(min(self._runs.values(), key=lambda r: r.used))
        if not self._free:
            # Every id is taken: drop the least recently used sequence outside this job. If the scheduler
            # still meant to use it, that request's next job fails cleanly (its KV is gone).
            victims = [s for s in self._seqs.values() if s.sid not in busy]
            if not victims:
                raise BackendError(f"llamacpp backend: more than {self.n_seq_max} sequences in one job")
            self._truncate(min(victims, key=lambda s: s.used), 0)
        return self._free.pop()

    # ---- imported runs that continue a device prefix ---------------------------------

    def _join_run(self, table: list[int], p0: int, busy: set[int]) -> _Seq | None:
        """A new sequence of the device prefix table[:j] and an imported run of table[j:...] covering p0."""
        bs = self.block_size
        n = -(-p0 // bs)
        for r in list(self._runs.values()):
            j = r.start
            e = min(j + len(r.blocks), len(table))
            if not j < n <= e or table[j:e] != r.blocks[:e - j]:
                continue
            holder = next((self._seqs[sid] for sid in self._holders.get(table[j - 1], ())
                           if self._seqs[sid].length >= j * bs and self._seqs[sid].blocks[:j] == table[:j]), None)
            if holder is None:
                continue
            seq = self._new_seq(busy | {holder.sid})
            self.model.seq_cp(holder.sid, seq.sid, 0, j * bs)  # shared cells, as a prefix hit
            self.model.seq_cp(r.sid, seq.sid, j * bs, e * bs)
            self._drop_run(r)  # its cells stay: the new sequence holds them now
            seq.blocks, seq.length = table[:e], e * bs
            for blk in seq.blocks:
                self._holders.setdefault(blk, set()).add(seq.sid)
            return seq
        return None

    def _drop_run(self, r: _Run) -> None:
        self.model.seq_rm(r.sid, -1, -1)
        del self._runs[r.sid]
        self._free.append(r.sid)

    def _drop_runs_with(self, blk: int) -> None:
        for r in [r for r in self._runs.values() if blk in r.blocks]:
            self._drop_run(r)

    def release_blocks(self, blocks) -> None:
        """The scheduler freed these blocks: remove every sequence's cells from them on."""
        if self.model is None:
            return
        bs = self.block_size
        for blk in blocks:
            self._drop_runs_with(int(blk))
            for sid in list(self._holders.get(int(blk), ())):
                seq = self._seqs[sid]
                self._truncate(seq, seq.blocks.index(int(blk)) * bs)

    # ---- block ops -------------------------------------------------------------------

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Only forks: `src` is runs of blocks, each of one sequence (its blocks [k, k + len)), and for each a
        new sequence takes that sequence's positions up to the run's end with the run's `dst` in its place, its
        cells shared (`llama_memory_seq_cp`), as a prefix hit's (the choices of `n` > 1 requests,
        engine/core/sched/choice_fork.py: a run starts at a leader's first block of its own, so runs split
        where one sequence's blocks stop following on). Any other block copy is not supported."""
        if self.model is None:
            raise BackendError("llamacpp backend: no model loaded")
        s_ids, d_ids = [int(b) for b in src], [int(b) for b in dst]
        if not s_ids or len(s_ids) != len(d_ids) or len(set(d_ids)) != len(d_ids) or set(s_ids) & set(d_ids):
            raise BackendError("llamacpp backend: copy_blocks is not supported but as forks "
                               "(runs of one sequence's blocks into as many other blocks)")
        forks = []
        i = 0
        while i < len(s_ids):
            owner = next((self._seqs[sid] for sid in self._holders.get(s_ids[i], ())), None)
            if owner is None:
                raise BackendError(f"llamacpp backend: copy_blocks is not supported but as forks, and block "
                                   f"{s_ids[i]} is in no sequence on this chip")
            k = owner.blocks.index(s_ids[i])
            j = i + 1
            while j < len(s_ids) and k + j - i < len(owner.blocks) and owner.blocks[k + j - i] == s_ids[j]:
                j += 1
            forks.append((owner, k, d_ids[i:j]))
            i = j
        self.release_blocks(d_ids)  # the destinations are the forks' from now on: any older holder is stale
        bs = self.block_size
        for owner, k, run in forks:
            end = min(owner.length, (k + len(run)) * bs)
            fork = self._new_seq({owner.sid})
            self.model.seq_cp(owner.sid, fork.sid, 0, end)
            fork.blocks, fork.length = (owner.blocks[:k] + run)[:-(-end // bs)], end
            for blk in fork.blocks:
                self._holders.setdefault(blk, set()).add(fork.sid)

    def swap_out(self, blocks: np.ndarray) -> np.ndarray:
        """Each block's KV as llama.cpp's per-sequence state of its positions alone (see workers.llamacpp.kv_blocks)."""
        self._loaded()
        blocks = np.asarray(blocks, np.int64).reshape(-1).tolist()
        out = np.zeros((len(blocks), self._kv_io.row_bytes), np.uint8)
        for i, blk in enumerate(blocks):
            held = self._full_holder(blk)
            if held is None:
                raise BackendError(f"llamacpp backend: block {blk} holds no whole block of KV on this chip")
            sid, k = held
            self._kv_io.export_block(sid, k * self.block_size, out[i])
        return out

    def swap_in(self, blocks: np.ndarray, data: np.ndarray) -> None:
        """Import a run of consecutive whole blocks (from the host or disk tier). A run from position 0 is a
        sequence of its own; a run that starts later continues a prefix the device holds, and waits (`_Run`)
        for the lane that names it. A row that is not the next whole block is refused before the device KV
        changes (RecordRefused: the scheduler recomputes those tokens)."""
        from ipc.kv_slots import RecordRefused

        _, model = self._loaded()
        blocks = np.asarray(blocks, np.int64).reshape(-1).tolist()
        rows = np.ascontiguousarray(data).view(np.uint8).reshape(len(blocks), -1)
        if not blocks:
            return
        if len(set(blocks)) != len(blocks):
            raise RecordRefused("unsupported", "llamacpp backend: an import names a block twice")
        self._clock += 1
        sid = self._take_sid(set())
        try:
            start = self._kv_io.import_run(sid, rows)
        except Exception:  # RecordRefused (nothing kept), or anything else: the id goes back empty
            model.seq_rm(sid, -1, -1)
            self._free.append(sid)
            raise
        bs = self.block_size
        if start == 0:
            seq = _Seq(sid, used=self._clock)
            self._seqs[sid] = seq
            # the blocks were just handed to this sequence: any other holder's cells from them on are stale
            self._claim(seq, blocks, 0, len(blocks) * bs)
            seq.length = len(blocks) * bs
            return
        for blk in blocks:
            self._drop_runs_with(blk)
            for other in list(self._holders.get(blk, ())):
                o = self._seqs[other]
                self._truncate(o, o.blocks.index(blk) * bs)
        self._runs[sid] = _Run(sid, start, blocks, used=self._clock)
        while len(self._runs) > MAX_RUNS:
            self._drop_run(min(self._runs.values(), key=lambda r: r.used))

    def _full_holder(self, blk: int) -> tuple[int, int] | None:
        """A sequence id holding all of block `blk`'s positions, and the block's index in the sequence."""
        bs = self.block_size
        for sid in self._holders.get(int(blk), ()):
            s = self._seqs[sid]
            k = s.blocks.index(int(blk))
            if s.length >= (k + 1) * bs:
                return sid, k
        for r in self._runs.values():
            if int(blk) in r.blocks:
                return r.sid, r.start + r.blocks.index(int(blk))
        return None
