"""The `ChipBackend` interface: the one seam between npuserve and a chip runtime.

A backend owns the chip's device memory, including the paged KV cache
(`num_blocks` blocks of `block_size` tokens); the scheduler only ever names
block ids. A backend returns either logits (and the worker samples) or, for
backends that do no real compute (`stub`, `sim`), tokens directly.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field

import numpy as np

from ipc.records import Job, JobKind


class InactiveLanePolicy(str, enum.Enum):
    """What a compiled batch does with lanes that carry no sequence.

    MASK: the backend honours `lane_valid`: no input is read and no KV is
    written for an inactive lane, and its outputs are ignored.
    """

    MASK = "mask"


@dataclass(frozen=True)
class BatchProfile:
    batch: int  # the compiled batch size B
    inactive_lane_policy: InactiveLanePolicy = InactiveLanePolicy.MASK


@dataclass(frozen=True)
class KvLayout:
    block_size: int
    num_blocks: int
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = "float32"
    bytes_per_token: int = 0  # > 0: a token's KV is this many opaque bytes (a vendor layout, `ctypes`)

    def block_bytes(self) -> int:
        """Bytes of one block in the host format (K and V of every layer): the size of a host slot's payload."""
        if self.bytes_per_token:
            return self.block_size * self.bytes_per_token
        item = 2 if self.dtype in ("float16", "bfloat16") else 1 if self.dtype in ("int8", "uint8") else 4
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * item


@dataclass(frozen=True)
class KvTransferCost:
    """What moving KV costs against recomputing it on this backend: the tier policy's cost model.

    A promotion of n blocks is expected to take `base_s + n * per_block_s`;
    recomputing those tokens `n * block_size * prefill_s_per_token`.
    """

    base_s: float = 2e-4  # one transfer job's turnaround
    per_block_s: float = 1e-5
    prefill_s_per_token: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class BackendInfo:
    name: str
    vocab_size: int
    eos_ids: tuple[int, ...]
    max_seq: int
    profiles: tuple[BatchProfile, ...]
    kv: KvLayout
    chunked_prefill: bool = False  # incremental prefill numerically equal to one-shot
    model_sha256: str = ""  # identity of the loaded weights (generation key)
    # > 0: one prefill job may carry many lanes, each with its own number of new tokens (decode lanes
    # with one, prompt chunks with many), up to this many tokens in all: the scheduler's mixed batches.
    # 0: a prefill job carries one lane (the backend's compiled shapes separate prefill from decode).
    mixed_batch_tokens: int = 0
    # Not None: the backend exports and imports KV blocks (KV_EXPORT / KV_IMPORT jobs, swap_out / swap_in),
    # at this cost; None: its KV never leaves the chip (no host or disk tier for it).
    kv_transfer: KvTransferCost | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eos_ids": list(self.eos_ids),
            "max_seq": self.max_seq,
            "profiles": [{"batch": p.batch, "inactive_lane_policy": p.inactive_lane_policy.value} for p in self.profiles],
            "kv": self.kv.__dict__.copy(),
            "chunked_prefill": self.chunked_prefill,
            "model_sha256": self.model_sha256,
            "mixed_batch_tokens": self.mixed_batch_tokens,
            "kv_transfer": None if self.kv_transfer is None else self.kv_transfer.to_dict(),
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "BackendInfo":
        return cls(
            name=d["name"],
            vocab_size=int(d["vocab_size"]),
            eos_ids=tuple(int(x) for x in d["eos_ids"]),
            max_seq=int(d["max_seq"]),
            profiles=tuple(BatchProfile(int(p["batch"]), InactiveLanePolicy(p["inactive_lane_policy"])) for p in d["profiles"]),
            kv=KvLayout(**d["kv"]),
            chunked_prefill=bool(d.get("chunked_prefill", False)),
            model_sha256=d.get("model_sha256", ""),
            mixed_batch_tokens=int(d.get("mixed_batch_tokens", 0)),
            kv_transfer=None if d.get("kv_transfer") is None else KvTransferCost(**d["kv_transfer"]),
            extra=dict(d.get("extra", {})),
        )


@dataclass
class StepOutput:
    """What prefill/decode return: logits [B, V] float32, or tokens [B] int32.

    The logits may be a read-only view of the runtime's own buffer (llamacpp):
    read them before the backend's next call.
    """

    logits: np.ndarray | None = None
    tokens: np.ndarray | None = None
    # verification jobs (Job.draft_lens): logits [len(spec_verify.draft_rows(job)), V] of the draft rows.
    # A backend that makes them says so with describe().extra["spec_verify"] = True.
    draft_logits: np.ndarray | None = None
    # lanes asking for their prompt's logprobs (ipc.logprob_wants.PROMPT): logits of the rows
    # `workers.logprob_alternatives.prompt_rows(job)` names, in that order. A backend that makes them says so
    # with describe().extra["prompt_logprobs"] = True.
    prompt_logits: np.ndarray | None = None


class BackendError(RuntimeError):
    """A chip-level failure: the job failed and the KV it touched is unknown."""


class ChipBackend(abc.ABC):
    """One chip's runtime. Not thread-safe: one worker process drives it."""

    @abc.abstractmethod
    def describe(self) -> BackendInfo: ...

    @abc.abstractmethod
    def load(self, package) -> None:
        """Load a verified model package (`workers.model_package.ModelPackage`) or None for a built-in default."""

    @abc.abstractmethod
    def unload(self) -> None: ...

    @abc.abstractmethod
    def prefill(self, job: Job) -> StepOutput: ...

    @abc.abstractmethod
    def decode(self, job: Job) -> StepOutput: ...

    @abc.abstractmethod
    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy KV blocks src[i] -> dst[i] on the device (prefix sharing, copy-on-write)."""

    @abc.abstractmethod
    def swap_out(self, blocks: np.ndarray) -> np.ndarray:
        """Return the KV content of `blocks` as one host array [n, ...] (export to the host tier).

        Row i is block i's bytes in the host format, `describe().kv.block_bytes()` long.
        """

    @abc.abstractmethod
    def swap_in(self, blocks: np.ndarray, data: np.ndarray) -> None:
        """Write host KV content (from swap_out) into `blocks`."""

    def decode_steps(self, job: Job, penalties=None) -> tuple[np.ndarray, np.ndarray] | None:
        """A multi-step decode job's `job.decode_steps` steps on the device, each step fed the token the step
        before sampled there, with `workers.sampling`'s sampler.

        Returns (tokens int32 [B, n], logprobs float32 [B, n]): what the worker's host loop (`decode` per
        step, sampling on the host) returns for the job, without a host round trip per step. None: this
        backend has no device loop (the default), so the worker runs the host loop. The worker asks only for
        jobs the device can sample alone (`workers.execute_job.device_loop_job`). A backend with one says so in
        `describe().extra["device_decode_loop"]`.
        `penalties` (`workers.penalties.DevicePenalties`): the lanes' penalties and counts before step 0;
        a backend whose device loop cannot apply them returns None (the host loop applies them).
        """
        return None

    def release_blocks(self, blocks: list[int]) -> None:
        """The scheduler freed these blocks: nothing will read their KV again (a control message, not a job).

        Backends whose KV lives in the blocks have nothing to do; one that keeps
        its own KV store (llama.cpp's cells) frees what it holds for them.
        """

    # ---- LoRA adapters (a backend that serves them says so in describe().extra["lora"]) ----

    def read_adapter(self, path: str, sha256: str):
        """An adapter package read into host memory, in this backend's form (kept in the worker's host cache)."""
        raise BackendError(f"{type(self).__name__}: LoRA adapters are not supported by this backend")

    def load_adapter(self, slot: int, host_adapter) -> None:
        """Put a `read_adapter` result into device slot `slot` (replacing what it held); jobs then name the slot
        in `Job.adapter`."""
        raise BackendError(f"{type(self).__name__}: LoRA adapters are not supported by this backend")

    def unload_adapter(self, slot: int) -> None:
        """Free device slot `slot`."""

    def health(self) -> dict:
        return {"ok": True}


class OneStepBackend(ChipBackend):
    """A backend whose prefill and decode are one computation over the job's new tokens (`_run`)."""

    def prefill(self, job: Job) -> StepOutput:
        if job.kind != JobKind.PREFILL:
            raise ValueError(f"prefill called with a {job.kind.name} job")
        return self._run(job)

    def decode(self, job: Job) -> StepOutput:
        if job.kind != JobKind.DECODE:
            raise ValueError(f"decode called with a {job.kind.name} job")
        return self._run(job)

    @abc.abstractmethod
    def _run(self, job: Job) -> StepOutput: ...
