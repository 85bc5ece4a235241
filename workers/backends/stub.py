"""The `stub` backend: no compute, deterministic tokens.

It exists to measure npuserve's own overhead (rings, sockets, scheduling)
with the chip taken out of the picture, and to give scheduler and worker
tests a backend with exactly predictable behaviour.

A sampled lane's token is a hash of (seed, position) only -- never of the
lane index, the batch or the chip -- so a request gets the same tokens alone,
in any batch, on any chip and after a retry, like real seeded sampling does.
The hash is mapped into [0, vocab) *skipping every EOS id*, so a stub request
never stops on EOS: its length is governed by max_tokens (and stop sequences).
"""

from __future__ import annotations

import numpy as np

from ipc.records import Job, JobKind
from workers.backends.base import (
    BackendError,
    BackendInfo,
    BatchProfile,
    ChipBackend,
    KvLayout,
    KvTransferCost,
    StepOutput,
)
from workers.backends.block_ids import check_block_ids, check_copy_pair

# The stub keeps no KV, but declares a nominal one-float-per-token layout so
# that host-tier code sizing its pools from the layout never sees zero bytes.
_STUB_KV = dict(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser over uint64 values (wrapping arithmetic is the point)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def stub_tokens(seed: np.ndarray, position: np.ndarray, vocab_size: int, eos_ids: tuple[int, ...]) -> np.ndarray:
    """Token for each (seed, position) pair: a hash mapped into [0, vocab) minus the EOS ids."""
    seed = np.asarray(seed, dtype=np.uint64)
    pos = np.asarray(position, dtype=np.int64).astype(np.uint64)
    h = _splitmix64(seed ^ _splitmix64(pos))
    excluded = sorted({int(e) for e in eos_ids if 0 <= int(e) < vocab_size})
    room = vocab_size - len(excluded)
    assert room > 0, "vocabulary consists only of EOS ids"
    tok = (h % np.uint64(room)).astype(np.int64)
    for e in excluded:  # ascending: shift past each excluded id in turn
        tok += tok >= e
    return tok.astype(np.int32)


class StubBackend(ChipBackend):
    """Deterministic tokens, no KV, no compute. Supports chunked prefill trivially."""

    name = "stub"

    def __init__(
        self,
        *,
        vocab_size: int = 320,
        eos_ids: tuple[int, ...] = (257,),
        max_seq: int = 2048,
        block_size: int = 16,
        num_blocks: int = 4096,
        profiles: tuple[int, ...] = (1, 4, 8, 16),
        chip_id: int = 0,
        fail_job: int = 0,
        fail_chip: int = 0,
    ) -> None:
        """`fail_job=N` (chaos): the N-th prefill/decode call of chip `fail_chip` raises BackendError, once."""
        if vocab_size <= len({e for e in eos_ids if 0 <= e < vocab_size}):
            raise ValueError("vocab_size must leave at least one non-EOS token")
        if not profiles or any(int(b) < 1 for b in profiles):
            raise ValueError("profiles must be positive batch sizes")
        if block_size < 1 or num_blocks < 1 or max_seq < 1:
            raise ValueError("block_size, num_blocks and max_seq must be positive")
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.max_seq = int(max_seq)
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.profiles = tuple(sorted(int(b) for b in profiles))
        self.chip_id = int(chip_id)
        self.loaded = False
        self.fail_job = int(fail_job) if int(fail_chip) == self.chip_id else 0
        self.jobs_run = 0

    # -- description and lifecycle -------------------------------------------------

    def describe(self) -> BackendInfo:
        return BackendInfo(
            name=self.name,
            vocab_size=self.vocab_size,
            eos_ids=self.eos_ids,
            max_seq=self.max_seq,
            profiles=tuple(BatchProfile(b) for b in self.profiles),
            kv=KvLayout(block_size=self.block_size, num_blocks=self.num_blocks, **_STUB_KV),
            chunked_prefill=True,
            # its "KV" is nominal zeros and a prompt costs nothing: moving is never cheaper than recomputing
            kv_transfer=KvTransferCost(base_s=2e-4, per_block_s=1e-6, prefill_s_per_token=0.0),
            # it "samples on the device" (returns tokens, no logits): structured output cannot mask it
            extra={"chip_id": self.chip_id, "samples_on_device": True},
        )

    def load(self, package) -> None:
        """Accept any package (or None): the stub has no weights to load."""
        self.loaded = True

    def unload(self) -> None:
        self.loaded = False

    def health(self) -> dict:
        return {"ok": True, "loaded": self.loaded, "chip_id": self.chip_id}

    # -- compute ---------------------------------------------------------------------

    def prefill(self, job: Job) -> StepOutput:
        self._check(job, JobKind.PREFILL)
        return StepOutput(tokens=self.sampled_tokens(job))

    def decode(self, job: Job) -> StepOutput:
        self._check(job, JobKind.DECODE)
        return StepOutput(tokens=self.sampled_tokens(job))

    def sampled_tokens(self, job: Job) -> np.ndarray:
        """tokens[B]: the stub token at position context_lens[lane] where the lane samples, else -1."""
        out = np.full(job.batch, -1, dtype=np.int32)
        lanes = np.flatnonzero((np.asarray(job.lane_valid) != 0) & (np.asarray(job.sample) != 0))
        if lanes.size:
            out[lanes] = stub_tokens(job.seed[lanes], job.context_lens[lanes], self.vocab_size, self.eos_ids)
        return out

    def _check(self, job: Job, kind: JobKind) -> None:
        if not self.loaded:
            raise BackendError(f"{self.name} backend on chip {self.chip_id}: no model loaded")
        self.jobs_run += 1
        if self.jobs_run == self.fail_job:
            raise BackendError(f"{self.name} backend on chip {self.chip_id}: injected failure of job "
                               f"{self.jobs_run} (fail_job)")
        if job.kind != kind:
            raise ValueError(f"{kind.name.lower()} called with a {job.kind.name} job")
        if job.batch and int(np.max(job.context_lens)) > self.max_seq:
            raise ValueError(f"job {job.job_id}: context length exceeds max_seq={self.max_seq}")

    # -- KV: the stub keeps none --------------------------------------------------------

    def _block_shape(self) -> tuple[int, ...]:
        # the ref backend's host swap format (workers/paged_kv.py): [2 (k/v), layers, block, kv_heads, head_dim]
        return (2, _STUB_KV["num_layers"], self.block_size, _STUB_KV["num_kv_heads"], _STUB_KV["head_dim"])

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        check_copy_pair(src, dst, self.num_blocks)

    def swap_out(self, blocks: np.ndarray) -> np.ndarray:
        """Zeros shaped [n, 2 (k/v), layers, block_size, kv_heads, head_dim] of the nominal layout."""
        blocks = check_block_ids(blocks, self.num_blocks)
        return np.zeros((blocks.size, *self._block_shape()), dtype=np.float32)

    def swap_in(self, blocks: np.ndarray, data: np.ndarray) -> None:
        blocks = check_block_ids(blocks, self.num_blocks)
        if np.shape(data) != (blocks.size, *self._block_shape()):
            raise ValueError(f"swap_in data shape {np.shape(data)} does not match {blocks.size} blocks")
