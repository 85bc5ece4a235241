"""The `ref` backend: a real NumPy transformer over a paged KV cache.

It is the correctness oracle of the project: whatever the scheduler does with
block tables, chunking and batching, the logits must equal a cache-free full
recompute (`full_recompute_logits`). Chunked prefill is declared supported
because it is numerically equal (to float32 rounding) to one-shot prefill.

Inputs are validated completely before the first KV write, so a rejected job
(ValueError) leaves the cache untouched; a failure after writing began is a
BackendError (the KV the job touched is unknown).

Tensor parallelism: with `tp_world` > 1 this worker is rank `tp_rank` of a
replica; it holds its slice of the heads (and their KV) and MLP columns and
sums partial results with its peers through the all-reduce segment
`tp_group` (`ipc.allreduce`), made by the replica's owner. A collective that
fails (a peer died, hung past `tp_timeout_s`, or aborted) fails the job like
any device fault, and poisons the group: the replica's workers are restarted
together.
"""

from __future__ import annotations

import numpy as np

from ipc.allreduce import AllReduce
from ipc.records import Job
from workers.backends.base import (BackendError, BackendInfo, BatchProfile, KvLayout, KvTransferCost, OneStepBackend,
                                   StepOutput)
from workers.default_package import ensure_default_package
from workers.logprob_alternatives import prompt_rows
from workers.lora.adapter_package import LoraWeights, check_against_package, read_adapter, read_adapter_facts
from workers.lora.lora_rows import LoraRows, LoraStack
from workers.model_package import ModelPackage
from workers.package_loader import load_package
from workers.package_manifest import PackageError
from workers.paged_kv import PagedKvCache
from workers.spec_verify import draft_rows
from workers.transformer import Transformer


class RefBackend(OneStepBackend):
    name = "ref"

    def __init__(self, *, num_blocks: int | None = None, chip_id: int = 0, tp_rank: int = 0, tp_world: int = 1,
                 tp_group: str = "", tp_timeout_s: float = 30.0, tp_mode: str = "shared", lora_slots: int = 8) -> None:
        if num_blocks is not None and num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if tp_world < 1 or not 0 <= tp_rank < tp_world:
            raise ValueError(f"tp_rank {tp_rank} outside 0..{tp_world - 1}")
        if tp_world > 1 and not tp_group:
            raise ValueError("tp_world > 1 needs tp_group (the all-reduce segment's name)")
        self._num_blocks = num_blocks
        self.chip_id = chip_id
        self.tp_rank, self.tp_world, self.tp_group = int(tp_rank), int(tp_world), tp_group
        self.tp_timeout_s, self.tp_mode = float(tp_timeout_s), tp_mode
        self.collective: AllReduce | None = None
        self.package: ModelPackage | None = None
        self.model: Transformer | None = None
        self.cache: PagedKvCache | None = None
        if lora_slots < 0:
            raise ValueError("lora_slots must be >= 0")
        # device slots of LoRA adapters (Job.adapter names them); lanes of any of them share a job
        self.adapters: list[LoraWeights | None] = [None] * int(lora_slots)
        self._stack: LoraStack | None = None  # the slots stacked for the gathered product; None: rebuild

    # ---- lifecycle -----------------------------------------------------------------

    def load(self, package: ModelPackage | str | None) -> None:
        """Load a verified package, a package path, or (None) the built-in tiny model."""
        if package is None:
            package = load_package(ensure_default_package())
        elif isinstance(package, str):
            package = load_package(package)
        package.check_tp_degree(self.tp_world)
        collective = None
        if self.tp_world > 1:
            collective = AllReduce(self.tp_group, self.tp_rank, timeout_s=self.tp_timeout_s, mode=self.tp_mode)
        try:
            model = Transformer(package.dims, package.weights(), vocab_size=package.vocab_size,
                                max_seq=package.max_seq, shard=(self.tp_rank, self.tp_world),
                                reduce=collective.allreduce if collective else None)
        except BaseException:
            if collective:
                collective.close()
            raise
        d = package.dims
        cache = PagedKvCache(layers=d.layers, num_blocks=self._num_blocks or package.kv_num_blocks,
                             block_size=package.block_size, kv_heads=model.kv_heads, head_dim=d.head_dim)
        self.unload()
        self.package, self.model, self.cache, self.collective = package, model, cache, collective

    def unload(self) -> None:
        if self.collective is not None:
            self.collective.close()
        self.package = self.model = self.cache = self.collective = None

    def _loaded(self) -> tuple[ModelPackage, Transformer, PagedKvCache]:
        if self.package is None or self.model is None or self.cache is None:
            raise BackendError("ref backend: no model loaded")
        return self.package, self.model, self.cache

    def describe(self) -> BackendInfo:
        pkg, _, cache = self._loaded()
        d = pkg.dims
        return BackendInfo(
            name=self.name,
            vocab_size=pkg.vocab_size,
            eos_ids=tuple(pkg.eos_ids),
            max_seq=pkg.max_seq,
            profiles=tuple(BatchProfile(b) for b in sorted(pkg.profiles)),
            kv=KvLayout(block_size=pkg.block_size, num_blocks=cache.num_blocks, num_layers=d.layers,
                        num_kv_heads=d.kv_heads, head_dim=d.head_dim, dtype="float32"),
            chunked_prefill=True,
            model_sha256=pkg.sha256,
            # NumPy pages: a block moves as one slice copy; a prompt token costs a small forward pass
            kv_transfer=KvTransferCost(base_s=2e-4, per_block_s=5e-6, prefill_s_per_token=1e-4),
            extra={"chip_id": self.chip_id, "package": pkg.path, "model_name": pkg.name,
                   "bos_id": pkg.bos_id, "pad_id": pkg.pad_id, "dims": d.to_dict(),
                   "tp": {"rank": self.tp_rank, "world": self.tp_world},
                   "spec_verify": self.tp_world == 1,  # draft rows: not proven across tensor-parallel ranks
                   "prompt_logprobs": True,
                   # LoRA: device slots, and lanes of different adapters may share a job
                   "lora": {"slots": len(self.adapters) if self.tp_world == 1 else 0, "mixed": True}},
        )

    def health(self) -> dict:
        ok = self.package is not None and not (self.collective is not None and self.collective.aborted)
        return {"ok": ok, "backend": self.name, "chip_id": self.chip_id,
                "model_sha256": self.package.sha256 if self.package else ""}

    # ---- LoRA adapters ---------------------------------------------------------------

    def read_adapter(self, path: str, sha256: str) -> LoraWeights:
        """The adapter's tensors, after checking it fits the loaded model (PackageError names the mismatch)."""
        pkg, _, _ = self._loaded()
        facts = read_adapter_facts(path)
        if sha256 and facts.sha256 != sha256:
            raise PackageError(f"{path}: manifest.json changed since the adapter was verified (sha256 differs)")
        check_against_package(facts, pkg)
        return read_adapter(facts)

    def load_adapter(self, slot: int, host_adapter: LoraWeights) -> None:
        if self.tp_world > 1:
            raise BackendError("ref backend: LoRA adapters are not served across tensor-parallel ranks")
        if not 0 <= slot < len(self.adapters):
            raise BackendError(f"ref backend: adapter slot {slot} outside 0..{len(self.adapters) - 1}")
        self.adapters[slot] = host_adapter
        self._stack = None

    def unload_adapter(self, slot: int) -> None:
        if 0 <= slot < len(self.adapters):
            self.adapters[slot] = None
            self._stack = None

    def _lora_rows(self, job: Job, lanes: np.ndarray, counts: np.ndarray) -> LoraRows | None:
        """The lanes' adapters (ValueError before any KV write for a slot that holds none)."""
        if not job.adapter.size:
            return None
        lane_slot = job.adapter[lanes].astype(np.int64)
        used = np.unique(lane_slot[lane_slot >= 0])
        for s in used:
            if s >= len(self.adapters) or self.adapters[s] is None:
                raise ValueError(f"adapter slot {int(s)} holds no adapter")
        if len(used) > 1 and self._stack is None:
            self._stack = LoraStack(self.adapters)
        return LoraRows.for_lanes(self.adapters, lane_slot, counts, self._stack if len(used) > 1 else None)

    # ---- compute -------------------------------------------------------------------

    def _run(self, job: Job) -> StepOutput:
        pkg, model, cache = self._loaded()
        lanes = self._validate(job, pkg, cache)
        logits = np.zeros((job.batch, pkg.vocab_size), dtype=np.float32)
        want = draft_rows(job)
        if len(lanes) == 0:
            return StepOutput(logits=logits)
        qs = job.query_start.astype(np.int64)
        starts, ends = qs[lanes], qs[lanes + 1]
        lora = self._lora_rows(job, lanes, ends - starts)
        # Valid lanes are packed back to back (inactive lanes own no tokens), but select explicitly.
        rows = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)])
        lane_starts = np.concatenate([[0], np.cumsum(ends - starts)])
        # draft rows as indices into the selected (packed) rows
        packed_at = np.full(len(job.tokens), -1, np.int64)
        packed_at[rows] = np.arange(len(rows))
        # prompt logprobs: the rows of the lanes that ask, after the draft rows
        wanted_prompt = prompt_rows(job)
        n_draft = len(want)
        if wanted_prompt.size:
            want = np.concatenate([np.asarray(want, np.int64).reshape(-1), wanted_prompt])
        extra = packed_at[want] if len(want) else None
        try:
            out = model.forward_paged(
                cache,
                job.tokens[rows].astype(np.int64),
                job.positions[rows].astype(np.int64),
                lane_starts,
                job.context_lens[lanes].astype(np.int64),
                job.block_tables[lanes].astype(np.int64),
                extra_rows=extra,
                lora=lora,
            )
        except Exception as e:  # noqa: BLE001 - after the first write the KV state is unknown
            if self.collective is not None:
                # The peers may be waiting in (or past) a collective this rank will not reach: poison the
                # group so they fail this job too, rather than pair their next call with the wrong one.
                self.collective.abort()
            raise BackendError(f"ref backend: {type(e).__name__}: {e}") from e
        logits[lanes] = out[:len(lanes)]
        at = len(lanes)
        return StepOutput(logits=logits, draft_logits=out[at:at + n_draft] if n_draft else None,
                          prompt_logits=out[at + n_draft:] if wanted_prompt.size else None)

    @staticmethod
    def _validate(job: Job, pkg: ModelPackage, cache: PagedKvCache) -> np.ndarray:
        """Indices of the valid lanes; ValueError (nothing written) when the job is unusable."""
        job.validate()
        lanes = np.flatnonzero(job.lane_valid)
        bs = cache.block_size
        slots: list[np.ndarray] = []
        for lane in lanes:
            toks, pos = job.lane_tokens(lane), job.lane_positions(lane)
            ctx = int(job.context_lens[lane])
            if len(toks) == 0:
                raise ValueError(f"valid lane {lane} carries no tokens")
            if ctx > pkg.max_seq:
                raise ValueError(f"lane {lane}: context {ctx} exceeds max_seq {pkg.max_seq}")
            if toks.min() < 0 or toks.max() >= pkg.vocab_size:
                raise ValueError(f"lane {lane}: token id outside 0..{pkg.vocab_size - 1}")
            if not np.array_equal(pos, np.arange(ctx - len(toks), ctx)):
                raise ValueError(f"lane {lane}: positions must run contiguously up to context_lens-1")
            need = -(-ctx // bs)
            table = job.block_tables[lane]
            if need > len(table) or table[:need].min() < 0 or table[:need].max() >= cache.num_blocks:
                raise ValueError(f"lane {lane}: block table does not cover {ctx} tokens with blocks in 0..{cache.num_blocks - 1}")
            slots.append(table[pos // bs].astype(np.int64) * bs + pos % bs)
        if slots:
            all_slots = np.concatenate(slots)
            if len(np.unique(all_slots)) != len(all_slots):
                raise ValueError("two tokens of the job write the same KV slot")
        return lanes

    # ---- KV ops --------------------------------------------------------------------

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._loaded()[2].copy_blocks(src, dst)

    def swap_out(self, blocks: np.ndarray) -> np.ndarray:
        return self._loaded()[2].swap_out(blocks)

    def swap_in(self, blocks: np.ndarray, data: np.ndarray) -> None:
        self._loaded()[2].swap_in(blocks, data)

    def swap_out_rows(self, blocks: np.ndarray):
        """What swap_out would return, as rows in place in the cache (ipc.kv_slots.ScatteredRows)."""
        return self._loaded()[2].host_rows(blocks)


_ORACLES: dict[tuple[str, str], Transformer] = {}


def _oracle_model(source) -> Transformer:
    if isinstance(source, Transformer):
        return source
    if isinstance(source, RefBackend):
        return source._loaded()[1]
    if isinstance(source, ModelPackage):
        key = (source.path, source.sha256)
        if key not in _ORACLES:
            _ORACLES.clear()  # keep at most one cached model
            _ORACLES[key] = Transformer(source.dims, source.weights(), vocab_size=source.vocab_size,
                                        max_seq=source.max_seq)
        return _ORACLES[key]
    raise TypeError("full_recompute_logits takes a ModelPackage, a Transformer or a loaded RefBackend")


def full_recompute_logits(package_or_weights, tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens), V] computed from scratch without any KV cache: the test oracle."""
    return _oracle_model(package_or_weights).dense_logits(tokens)
