"""The `ctypes` backend: a vendor chip runtime behind the C ABI of
`workers/native/npuserve_chip.h` (`simpler_model_prefill`,
`simpler_model_decode`, ...), loaded with ctypes.

The vendor functions take a sequence's KV as one contiguous buffer; npuserve
keeps KV paged. This backend owns the paged cache (host memory,
`num_blocks x block_size x kv_bytes_per_token` bytes, opaque to it), gathers a
lane's blocks into `kv_in` before a call and scatters the returned `kv_out`
(the new tokens' KV) back into the lane's blocks after it. Only the positions
the job writes are touched, so blocks shared through the prefix cache stay
intact.

Device-resident KV: a library that exports the optional group
(`simpler_kv_block_bytes`, `simpler_kv_init`, `simpler_kv_copy_out`,
`simpler_kv_copy_in`, `simpler_model_prefill_paged`,
`simpler_model_decode_paged`; all or none) keeps the paged cache itself, on
the device. This backend then holds no KV at all: it passes block tables to
the paged calls, and `swap_out` / `swap_in` (the KV tiers' export and import,
`workers.kv_transfer`) and `copy_blocks` go through `simpler_kv_copy_out` /
`simpler_kv_copy_in`, in the library's own block format.

Device-side multi-step decode: a library with device-resident KV that also
exports `simpler_model_decode_steps_paged` runs a multi-step decode job
(`executor.decode_steps = n`) as one call, n steps sampled on the device with
the host's sampler (`decode_steps`); the worker loops `decode` and samples
on the host otherwise (and for the jobs the device loop cannot take: see
`workers.execute_job.device_loop_job`). The backend option `device_loop=False`
ignores the symbol (a comparison, or a vendor loop not to be trusted).

Tensor parallelism: with `tp_world` > 1 the library must export
`simpler_tp_init`; this backend hands it the chip's rank and world and
npuserve's collective (an all-reduce over the replica's shared-memory
segment `tp_group`, `ipc.allreduce`) as a C callback, for a runtime that has
no collective of its own. A failed collective fails the call and poisons the
group (the replica restarts).

Loading is strict: a missing library, a missing symbol or a different ABI
version raises `NativeLibraryError` naming what is wrong. There is no silent
fallback to a stub: a misconfigured board would then serve made-up tokens
while looking healthy.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from pathlib import Path

import numpy as np

from ipc.allreduce import AllReduce, CollectiveError
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

ABI_VERSION = 1  # must equal SIMPLER_ABI_VERSION in npuserve_chip.h
NATIVE_DIR = Path(__file__).resolve().parent.parent / "native"
HEADER = NATIVE_DIR / "npuserve_chip.h"
REFERENCE_SOURCE = NATIVE_DIR / "reference_chip.c"

_MAX_EOS = 8
_MAX_PROFILES = 8
_STATUS = {0: "OK", -1: "SIMPLER_E_INVALID", -2: "SIMPLER_E_KV_CORRUPT", -3: "SIMPLER_E_DEVICE", -4: "SIMPLER_E_TOO_LONG"}
_REQUIRED = ("simpler_abi_version", "simpler_model_describe", "simpler_model_prefill", "simpler_model_decode")
DEVICE_KV = ("simpler_kv_block_bytes", "simpler_kv_init", "simpler_kv_copy_out", "simpler_kv_copy_in",
             "simpler_model_prefill_paged", "simpler_model_decode_paged")  # optional, all or none
DEVICE_LOOP = "simpler_model_decode_steps_paged"  # optional; needs the device-resident KV group
DEVICE_LOOP_PENALIZED = "simpler_model_decode_steps_penalized_paged"  # optional, beside DEVICE_LOOP
LORA = ("simpler_lora_slots", "simpler_lora_load", "simpler_lora_select")  # optional, all or none


class NativeLibraryError(BackendError):
    """The chip library cannot be used at all: missing, incomplete or of another ABI version."""


class SimplerModelInfo(ctypes.Structure):
    _fields_ = [
        ("abi_version", ctypes.c_int32),
        ("vocab", ctypes.c_int32),
        ("max_seq", ctypes.c_int32),
        ("n_eos", ctypes.c_int32),
        ("eos_ids", ctypes.c_int32 * _MAX_EOS),
        ("n_profiles", ctypes.c_int32),
        ("profiles", ctypes.c_int32 * _MAX_PROFILES),
        ("chunked_prefill", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("kv_bytes_per_token", ctypes.c_int64),
    ]


def build_reference_library(out_dir: str | os.PathLike, *, name: str = "libreference_chip.so",
                            defines: dict[str, object] | None = None, cc: str = "cc",
                            extra_source: str | None = None) -> Path:
    """Compile workers/native/reference_chip.c into out_dir (tests, demos, benchmarks).

    `extra_source`: C compiled into the same library after npuserve_chip.h (a test's extra or stub symbols)."""
    out = Path(out_dir) / name
    flags = [f"-D{k}={v}" for k, v in (defines or {}).items()]
    extra = [] if extra_source is None else ["-x", "c", "-"]
    cmd = [cc, "-shared", "-fPIC", "-O2", *flags, "-o", str(out), str(REFERENCE_SOURCE), *extra, "-lm"]
    source = None if extra_source is None else f'#include "{HEADER}"\n{extra_source}'
    proc = subprocess.run(cmd, input=source, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return out


ALLREDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t)


def _load_library(library: str) -> ctypes.CDLL:
    path = os.fspath(library)
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    except OSError as exc:
        raise NativeLibraryError(f"cannot load chip library {path!r}: {exc}") from None


def _bind(lib: ctypes.CDLL, library: str) -> None:
    missing = [s for s in _REQUIRED if not hasattr(lib, s)]
    if missing:
        raise NativeLibraryError(f"chip library {library!r} lacks symbol(s): {', '.join(missing)}")
    c_int, c_size, vp = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p
    lib.simpler_abi_version.argtypes = []
    lib.simpler_abi_version.restype = c_int
    lib.simpler_model_describe.argtypes = [c_int, ctypes.POINTER(SimplerModelInfo)]
    lib.simpler_model_describe.restype = c_int
    lib.simpler_model_prefill.argtypes = [c_int, vp, c_int, vp, c_size, vp, vp, c_int]
    lib.simpler_model_prefill.restype = c_int
    lib.simpler_model_decode.argtypes = [c_int, c_int, vp, vp, vp, vp, vp, vp, c_int]
    lib.simpler_model_decode.restype = c_int
    present = [s for s in DEVICE_KV if hasattr(lib, s)]
    if present and len(present) != len(DEVICE_KV):
        raise NativeLibraryError(f"chip library {library!r} exports part of the device-resident KV group; it "
                                 f"lacks: {', '.join(s for s in DEVICE_KV if s not in present)}")
    if present:
        i32 = ctypes.c_int32
        lib.simpler_kv_block_bytes.argtypes = [c_int, c_int]
        lib.simpler_kv_block_bytes.restype = ctypes.c_int64
        lib.simpler_kv_init.argtypes = [c_int, c_int, c_int]
        lib.simpler_kv_init.restype = c_int
        for fn in (lib.simpler_kv_copy_out, lib.simpler_kv_copy_in):
            fn.argtypes = [c_int, vp, c_int, vp, c_size]
            fn.restype = c_int
        lib.simpler_model_prefill_paged.argtypes = [c_int, vp, c_int, i32, vp, c_int, vp, c_int]
        lib.simpler_model_prefill_paged.restype = c_int
        lib.simpler_model_decode_paged.argtypes = [c_int, c_int, vp, vp, vp, vp, c_int, vp, c_int]
        lib.simpler_model_decode_paged.restype = c_int
    lora = [s for s in LORA if hasattr(lib, s)]
    if lora and len(lora) != len(LORA):
        raise NativeLibraryError(f"chip library {library!r} exports part of the LoRA group; it lacks: "
                                 f"{', '.join(s for s in LORA if s not in lora)}")
    if lora:
        lib.simpler_lora_slots.argtypes = [c_int]
        lib.simpler_lora_slots.restype = c_int
        lib.simpler_lora_load.argtypes = [c_int, c_int, vp, c_size]
        lib.simpler_lora_load.restype = c_int
        lib.simpler_lora_select.argtypes = [c_int, c_int, vp]
        lib.simpler_lora_select.restype = c_int
    if hasattr(lib, DEVICE_LOOP):
        if not present:
            raise NativeLibraryError(f"chip library {library!r} exports {DEVICE_LOOP} without the device-resident "
                                     f"KV group it needs ({', '.join(DEVICE_KV)})")
        fn = getattr(lib, DEVICE_LOOP)
        fn.argtypes = [c_int, c_int, c_int, vp, vp, vp, vp, c_int, vp, vp, vp, vp, vp, vp]
        fn.restype = c_int
        if hasattr(lib, DEVICE_LOOP_PENALIZED):
            fn = getattr(lib, DEVICE_LOOP_PENALIZED)
            fn.argtypes = [c_int, c_int, c_int, vp, vp, vp, vp, c_int, vp, vp, vp, vp,
                           ctypes.POINTER(SimplerLanePenalties), vp, vp]
            fn.restype = c_int


def device_kv_of(lib: ctypes.CDLL) -> bool:
    """Whether the library keeps the paged KV cache itself (exports the device-resident KV group)."""
    return hasattr(lib, DEVICE_KV[0])


def _file_sha256(path: str) -> str:
    """sha256 of the library file; "" when it was found on the loader's search path, not by path."""
    p = Path(path)
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class SimplerLanePenalties(ctypes.Structure):
    """npuserve_chip.h's simpler_lane_penalties: pointers to the per-lane arrays (workers.penalties)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "presence", "frequency", "repetition", "min_p", "min_tokens", "done", "seen_start", "seen_ids",
        "seen_counts", "bias_start", "bias_ids", "bias_values", "stop_start", "stop_ids")]


class CtypesBackend(ChipBackend):
    """One chip driven through a vendor shared library; the paged KV cache lives here."""

    name = "ctypes"

    def __init__(self, *, library: str, chip_id: int = 0, block_size: int = 16, num_blocks: int = 4096,
                 tp_rank: int = 0, tp_world: int = 1, tp_group: str = "", tp_timeout_s: float = 30.0,
                 device_loop: bool = True) -> None:
        if block_size < 1 or num_blocks < 1:
            raise ValueError("block_size and num_blocks must be positive")
        self.library = os.fspath(library)
        self.chip_id = int(chip_id)
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self._lib = _load_library(self.library)
        self.library_sha256 = _file_sha256(self.library)
        _bind(self._lib, self.library)
        version = int(self._lib.simpler_abi_version())
        if version != ABI_VERSION:
            raise NativeLibraryError(
                f"chip library {self.library!r} implements ABI version {version}; npuserve needs {ABI_VERSION}"
            )
        info = SimplerModelInfo()
        rc = self._lib.simpler_model_describe(self.chip_id, ctypes.byref(info))
        if rc != 0:
            raise NativeLibraryError(f"simpler_model_describe(chip {self.chip_id}) in {self.library!r} failed: {_STATUS.get(rc, rc)}")
        if info.abi_version != ABI_VERSION:
            raise NativeLibraryError(f"chip library {self.library!r} describes ABI version {info.abi_version}; npuserve needs {ABI_VERSION}")
        if not (0 < info.n_eos <= _MAX_EOS and 0 < info.n_profiles <= _MAX_PROFILES):
            raise NativeLibraryError(f"chip library {self.library!r} returned an invalid model description")
        if info.vocab <= 0 or info.max_seq <= 0 or info.kv_bytes_per_token <= 0:
            raise NativeLibraryError(f"chip library {self.library!r} returned an invalid model description")
        self.vocab_size = int(info.vocab)
        self.max_seq = int(info.max_seq)
        self.eos_ids = tuple(int(info.eos_ids[i]) for i in range(info.n_eos))
        self.profiles = tuple(sorted(int(info.profiles[i]) for i in range(info.n_profiles)))
        self.chunked_prefill = bool(info.chunked_prefill)
        self.kv_bytes_per_token = int(info.kv_bytes_per_token)
        self._cache: np.ndarray | None = None
        self.device_kv = device_kv_of(self._lib)
        # multi-step decode jobs run on the device (_bind made sure the library has device KV then)
        self.device_loop = bool(device_loop) and hasattr(self._lib, DEVICE_LOOP)
        self.device_loop_penalized = self.device_loop and hasattr(self._lib, DEVICE_LOOP_PENALIZED)
        self._device_loaded = False
        # bytes per token of a block in the transfer format: the library's own (device) or kv_in's (host)
        self.block_token_bytes = self._device_block_token_bytes() if self.device_kv else self.kv_bytes_per_token
        self.lora_slots = self._lora_slot_count()
        self._lora_loaded: set[int] = set()  # device slots holding an adapter
        self.tp_rank, self.tp_world = int(tp_rank), int(tp_world)
        self.collective: AllReduce | None = None
        self._reduce_cb = None  # the C callback object: kept alive as long as the library may call it
        if self.tp_world > 1:
            self._init_tp(tp_group, float(tp_timeout_s))

    def _lora_slot_count(self) -> int:
        if not hasattr(self._lib, LORA[0]):
            return 0
        n = int(self._lib.simpler_lora_slots(self.chip_id))
        if n <= 0:
            raise NativeLibraryError(f"simpler_lora_slots(chip {self.chip_id}) in {self.library!r} returned "
                                     f"{_STATUS.get(n, n)}: npuserve needs a positive slot count")
        return n

    def _device_block_token_bytes(self) -> int:
        n = int(self._lib.simpler_kv_block_bytes(self.chip_id, self.block_size))
        if n <= 0 or n % self.block_size:
            raise NativeLibraryError(f"simpler_kv_block_bytes(chip {self.chip_id}, {self.block_size}) in "
                                     f"{self.library!r} returned {_STATUS.get(n, n)}: npuserve needs a positive "
                                     f"multiple of the block size")
        return n // self.block_size

    def _init_tp(self, group: str, timeout_s: float) -> None:
        init = getattr(self._lib, "simpler_tp_init", None)
        if init is None:
            raise NativeLibraryError(f"chip library {self.library!r} lacks simpler_tp_init: it cannot run "
                                     f"tensor parallel (board.chips_per_replica = {self.tp_world})")
        if not group:
            raise ValueError("tp_world > 1 needs tp_group (the all-reduce segment's name)")
        init.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ALLREDUCE_FN, ctypes.c_void_p]
        init.restype = ctypes.c_int
        self.collective = ar = AllReduce(group, self.tp_rank, timeout_s=timeout_s)

        def reduce(_ctx, buf, count) -> int:
            view = np.ctypeslib.as_array(buf, shape=(int(count),))
            try:
                view[:] = ar.allreduce(view)
            except CollectiveError:
                return 1
            return 0

        self._reduce_cb = ALLREDUCE_FN(reduce)
        rc = init(self.chip_id, self.tp_rank, self.tp_world, self._reduce_cb, None)
        if rc != 0:
            raise NativeLibraryError(f"simpler_tp_init(chip {self.chip_id}, rank {self.tp_rank}, world "
                                     f"{self.tp_world}) in {self.library!r} failed: {_STATUS.get(rc, rc)}")

    # -- description and lifecycle -------------------------------------------------

    def describe(self) -> BackendInfo:
        return BackendInfo(
            name=self.name,
            vocab_size=self.vocab_size,
            eos_ids=self.eos_ids,
            max_seq=self.max_seq,
            profiles=tuple(BatchProfile(b) for b in self.profiles),
            kv=KvLayout(block_size=self.block_size, num_blocks=self.num_blocks, dtype="uint8",
                        bytes_per_token=self.block_token_bytes),
            chunked_prefill=self.chunked_prefill,
            # host KV: the paged cache is this process's memory, a block moves as one row copy; device KV: one
            # simpler_kv_copy_out/_in call per transfer (the ABI gives no cost model, so the same figures)
            kv_transfer=KvTransferCost(base_s=2e-4, per_block_s=2e-6, prefill_s_per_token=1e-4),
            model_sha256=self.library_sha256,  # the library is the model: rebuilding it is a new generation
            extra={"library": self.library, "chip_id": self.chip_id, "abi_version": ABI_VERSION,
                   "kv_bytes_per_token": self.kv_bytes_per_token, "device_kv": self.device_kv,
                   "device_decode_loop": self.device_loop,
                   "tp": {"rank": self.tp_rank, "world": self.tp_world},
                   **({"lora": {"slots": self.lora_slots if self.tp_world == 1 else 0, "mixed": True}}
                      if self.lora_slots else {})},
        )

    # -- LoRA adapters (the optional simpler_lora_* group) ----------------------------

    def read_adapter(self, path: str, sha256: str) -> bytes:
        """The adapter's weights file as the library takes it (the daemon checked it against the base package)."""
        if not self.lora_slots:
            return super().read_adapter(path, sha256)
        from workers.lora.adapter_package import ADAPTER_FILE, read_adapter_facts
        from workers.package_manifest import PackageError

        facts = read_adapter_facts(path)
        if sha256 and facts.sha256 != sha256:
            raise PackageError(f"{path}: manifest.json changed since the adapter was verified (sha256 differs)")
        with open(os.path.join(facts.path, ADAPTER_FILE), "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != facts.manifest["files"][ADAPTER_FILE]:
            raise PackageError(f"{path}/{ADAPTER_FILE}: sha256 does not match the manifest")
        return data

    def load_adapter(self, slot: int, host_adapter: bytes) -> None:
        if not self.lora_slots:
            return super().load_adapter(slot, host_adapter)
        buf = np.frombuffer(host_adapter, dtype=np.uint8)
        rc = self._lib.simpler_lora_load(self.chip_id, int(slot), _ptr(buf), buf.nbytes)
        if rc != 0:
            raise BackendError(f"simpler_lora_load(chip {self.chip_id}, slot {slot}) failed: {_STATUS.get(rc, rc)}")
        self._lora_loaded.add(int(slot))

    def unload_adapter(self, slot: int) -> None:
        if self.lora_slots and int(slot) in self._lora_loaded:
            self._lib.simpler_lora_load(self.chip_id, int(slot), None, 0)
            self._lora_loaded.discard(int(slot))

    def _check_adapters(self, job: Job) -> None:
        """ValueError (the job is refused, nothing written) for a lane naming a slot that holds no adapter."""
        if job.adapter.size:
            used = {int(s) for s, v in zip(job.adapter, job.lane_valid) if v and s >= 0}
            if not used <= self._lora_loaded:
                raise ValueError(f"job {job.job_id}: adapter slot(s) {sorted(used - self._lora_loaded)} hold no "
                                 f"adapter")

    def _select(self, job: Job, lanes: list[int] | None = None) -> None:
        """simpler_lora_select for the next model call: every lane of the job, or the listed lanes in order."""
        if not self.lora_slots:
            return
        if not job.adapter.size:
            slots = np.zeros(0, np.int32)
        else:
            slots = np.ascontiguousarray(job.adapter if lanes is None else job.adapter[lanes], dtype=np.int32)
        rc = self._lib.simpler_lora_select(self.chip_id, int(slots.size), _ptr(slots) if slots.size else None)
        if rc != 0:
            raise self._fail("simpler_lora_select", rc, job)

    def load(self, package) -> None:
        """Allocate the KV cache (here, or the library's device pool). The model is whatever the library was built with."""
        if self.device_kv:
            rc = self._lib.simpler_kv_init(self.chip_id, self.num_blocks, self.block_size)
            if rc != 0:
                raise BackendError(f"simpler_kv_init(chip {self.chip_id}, {self.num_blocks} blocks) failed: "
                                   f"{_STATUS.get(rc, rc)}")
            self._device_loaded = True
            return
        self._cache = np.zeros((self.num_blocks, self.block_size, self.kv_bytes_per_token), dtype=np.uint8)

    def unload(self) -> None:
        self._cache = None
        self._device_loaded = False  # the library's pool is dropped by the next simpler_kv_init

    def _loaded(self) -> bool:
        return self._device_loaded if self.device_kv else self._cache is not None

    def health(self) -> dict:
        return {"ok": True, "loaded": self._loaded(), "chip_id": self.chip_id, "library": self.library,
                "device_kv": self.device_kv, "device_decode_loop": self.device_loop}

    # -- paged KV <-> contiguous kv_in / kv_out ------------------------------------------

    def _kv_cache(self) -> np.ndarray | None:
        """The host paged cache (None with device-resident KV); raises before load."""
        if not self._loaded():
            raise BackendError(f"ctypes backend on chip {self.chip_id}: no model loaded")
        return self._cache

    def _lane_slots(self, table: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(block id, offset) of positions [start, stop) of a lane, validating its block table."""
        pos = np.arange(start, stop, dtype=np.int64)
        idx = pos // self.block_size
        if idx.size and idx[-1] >= table.shape[0]:
            raise ValueError(f"block table has {table.shape[0]} entries; position {stop - 1} needs more")
        blocks = table[idx].astype(np.int64)
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise ValueError(f"block table names a block outside [0, {self.num_blocks}) for positions {start}..{stop - 1}")
        return blocks, pos % self.block_size

    def _gather(self, table: np.ndarray, n: int) -> np.ndarray:
        cache = self._kv_cache()
        blocks, offs = self._lane_slots(table, 0, n)
        return np.ascontiguousarray(cache[blocks, offs])  # [n, kv_bytes_per_token]


    def _lane_start(self, job: Job, lane: int, n_new: int) -> int:
        pos = job.lane_positions(lane)
        start = int(pos[0])
        if not np.array_equal(pos, np.arange(start, start + n_new)):
            raise ValueError(f"job {job.job_id} lane {lane}: positions must be consecutive")
        if start + n_new > self.max_seq:
            raise ValueError(f"job {job.job_id} lane {lane}: {start + n_new} tokens exceed max_seq={self.max_seq}")
        return start

    def _fail(self, fn: str, rc: int, job: Job) -> BackendError:
        if self.collective is not None:
            self.collective.abort()  # peers may wait in a collective this rank will not reach
        return BackendError(f"{fn} on chip {self.chip_id} failed for job {job.job_id}: {_STATUS.get(rc, rc)} ({rc})")

    # -- compute ---------------------------------------------------------------------

    def prefill(self, job: Job) -> StepOutput:
        """Each valid lane is one sequence; one vendor call per lane (prefill jobs are normally B=1).

        Every lane's positions and block table are validated before the first call,
        so a rejected job writes no KV at all.
        """
        if job.kind != JobKind.PREFILL:
            raise ValueError(f"prefill called with a {job.kind.name} job")
        self._kv_cache()
        plan = []
        for lane in range(job.batch):
            tokens = np.ascontiguousarray(job.lane_tokens(lane), dtype=np.int32)
            if not job.lane_valid[lane] or tokens.size == 0:
                continue
            start = self._lane_start(job, lane, tokens.size)
            table = np.asarray(job.block_tables[lane])
            self._lane_slots(table, 0, start)
            plan.append((lane, tokens, start, table, self._lane_slots(table, start, start + tokens.size)))
        self._check_adapters(job)
        logits = np.zeros((job.batch, self.vocab_size), dtype=np.float32)
        if self.device_kv:
            for lane, tokens, start, table, _ in plan:
                self._select(job, [lane])
                t = np.ascontiguousarray(table, dtype=np.int32)
                rc = self._lib.simpler_model_prefill_paged(self.chip_id, _ptr(tokens), int(tokens.size), start,
                                                           _ptr(t), int(t.size), _ptr(logits[lane]), self.vocab_size)
                if rc != 0:
                    raise self._fail("simpler_model_prefill_paged", rc, job)
            return StepOutput(logits=logits)
        for lane, tokens, start, table, out_slots in plan:
            kv_in = self._gather(table, start)  # after earlier lanes' writes, in case they share blocks
            kv_out = np.empty((tokens.size, self.kv_bytes_per_token), dtype=np.uint8)
            self._select(job, [lane])
            rc = self._lib.simpler_model_prefill(
                self.chip_id, _ptr(tokens), int(tokens.size), _ptr(kv_in) if kv_in.size else None,
                kv_in.nbytes, _ptr(kv_out), _ptr(logits[lane]), self.vocab_size,
            )
            if rc != 0:
                raise self._fail("simpler_model_prefill", rc, job)
            self._kv_cache()[out_slots] = kv_out
        return StepOutput(logits=logits)

    def decode(self, job: Job) -> StepOutput:
        if job.kind != JobKind.DECODE:
            raise ValueError(f"decode called with a {job.kind.name} job")
        self._kv_cache()
        self._check_adapters(job)
        if self.device_kv:
            return self._decode_paged(job)
        b = job.batch
        valid = np.ascontiguousarray(job.lane_valid, dtype=np.uint8)
        tokens = np.zeros(b, dtype=np.int32)
        kv_in_ptrs = (ctypes.c_void_p * b)()
        kv_out_ptrs = (ctypes.c_void_p * b)()
        kv_sizes = np.zeros(b, dtype=np.uintp)
        keep: list[tuple[tuple[np.ndarray, np.ndarray], np.ndarray, np.ndarray]] = []  # buffers live until the call returns
        for lane in range(b):
            if not valid[lane]:
                continue
            tok = job.lane_tokens(lane)
            if tok.size != 1:
                raise ValueError(f"job {job.job_id} decode lane {lane} must carry exactly one token")
            tokens[lane] = tok[0]
            start = self._lane_start(job, lane, 1)
            table = np.asarray(job.block_tables[lane])
            kv_in = self._gather(table, start)
            out_slots = self._lane_slots(table, start, start + 1)
            kv_out = np.empty((1, self.kv_bytes_per_token), dtype=np.uint8)
            kv_in_ptrs[lane] = _ptr(kv_in) if kv_in.size else None
            kv_out_ptrs[lane] = _ptr(kv_out)
            kv_sizes[lane] = kv_in.nbytes
            keep.append((out_slots, kv_in, kv_out))
        logits = np.zeros((b, self.vocab_size), dtype=np.float32)
        if keep:
            self._select(job)
            rc = self._lib.simpler_model_decode(
                self.chip_id, b, _ptr(tokens), _ptr(valid), ctypes.addressof(kv_in_ptrs),
                _ptr(kv_sizes), ctypes.addressof(kv_out_ptrs), _ptr(logits), self.vocab_size,
            )
            if rc != 0:
                raise self._fail("simpler_model_decode", rc, job)
            cache = self._kv_cache()
            for out_slots, _, kv_out in keep:
                cache[out_slots] = kv_out
        return StepOutput(logits=logits)

    def _decode_paged(self, job: Job) -> StepOutput:
        b = job.batch
        valid = np.ascontiguousarray(job.lane_valid, dtype=np.uint8)
        tokens = np.zeros(b, dtype=np.int32)
        starts = np.zeros(b, dtype=np.int32)
        tables = np.ascontiguousarray(job.block_tables, dtype=np.int32).reshape(b, -1)
        for lane in range(b):
            if not valid[lane]:
                continue
            tok = job.lane_tokens(lane)
            if tok.size != 1:
                raise ValueError(f"job {job.job_id} decode lane {lane} must carry exactly one token")
            tokens[lane] = tok[0]
            starts[lane] = self._lane_start(job, lane, 1)
            self._lane_slots(tables[lane], 0, int(starts[lane]) + 1)
        logits = np.zeros((b, self.vocab_size), dtype=np.float32)
        if valid.any():
            self._select(job)
            rc = self._lib.simpler_model_decode_paged(self.chip_id, b, _ptr(tokens), _ptr(valid), _ptr(starts),
                                                      _ptr(tables), int(tables.shape[1]), _ptr(logits),
                                                      self.vocab_size)
            if rc != 0:
                raise self._fail("simpler_model_decode_paged", rc, job)
        return StepOutput(logits=logits)

    def decode_steps(self, job: Job, penalties=None) -> tuple[np.ndarray, np.ndarray] | None:
        """All `job.decode_steps` steps in one `simpler_model_decode_steps_paged` call, sampled on the device.

        Tokens int32 [B, n] (-1 on inactive lanes) and logprobs float32 [B, n] (0 where a lane does not want
        them), as the worker's host loop returns them; None without the symbol. Every lane's table is
        checked to reach its last step's position before the call, so a rejected job writes no KV.
        """
        if not self.device_loop or (penalties is not None and not self.device_loop_penalized):
            return None
        if job.kind != JobKind.DECODE:
            raise ValueError(f"decode_steps called with a {job.kind.name} job")
        self._kv_cache()
        b, n = job.batch, max(1, int(job.decode_steps))
        valid = np.ascontiguousarray(job.lane_valid, dtype=np.uint8)
        tokens = np.zeros(b, dtype=np.int32)
        starts = np.zeros(b, dtype=np.int32)
        tables = np.ascontiguousarray(job.block_tables, dtype=np.int32).reshape(b, -1)
        for lane in np.flatnonzero(valid).tolist():
            tok = job.lane_tokens(lane)
            if tok.size != 1:
                raise ValueError(f"job {job.job_id} decode lane {lane} must carry exactly one token")
            tokens[lane] = tok[0]
            starts[lane] = start = self._lane_start(job, lane, 1)
            if start + n > self.max_seq:
                raise ValueError(f"job {job.job_id} lane {lane}: {start + n} tokens exceed max_seq={self.max_seq}")
            self._lane_slots(tables[lane], 0, start + n)
        out_tokens = np.full((b, n), -1, dtype=np.int32)
        out_logprobs = np.zeros((b, n), dtype=np.float32)
        if not valid.any():
            return out_tokens, out_logprobs
        self._check_adapters(job)
        self._select(job)
        want = (np.asarray(job.want_logprobs) != 0) & (valid != 0)
        temperature = np.ascontiguousarray(job.temperature, dtype=np.float32)
        top_p = np.ascontiguousarray(job.top_p, dtype=np.float32)
        top_k = np.ascontiguousarray(job.top_k, dtype=np.int32)
        seed = np.ascontiguousarray(job.seed, dtype=np.uint64)
        head = (self.chip_id, b, n, _ptr(tokens), _ptr(valid), _ptr(starts), _ptr(tables), int(tables.shape[1]),
                _ptr(temperature), _ptr(top_p), _ptr(top_k), _ptr(seed))
        tail = (_ptr(out_tokens), _ptr(out_logprobs) if want.any() else None)
        if penalties is None:
            symbol = DEVICE_LOOP
            rc = getattr(self._lib, DEVICE_LOOP)(*head, *tail)
        else:
            symbol = DEVICE_LOOP_PENALIZED
            arrays = penalties.c_arrays()  # kept alive for the call
            if any(arrays[k].shape != (b,) for k in ("presence", "min_tokens", "done")):
                raise ValueError(f"job {job.job_id}: penalties for another batch than {b}")
            st = SimplerLanePenalties(*(arrays[name].ctypes.data if arrays[name].size else None
                                        for name, _ in SimplerLanePenalties._fields_))
            rc = getattr(self._lib, DEVICE_LOOP_PENALIZED)(*head, ctypes.byref(st), *tail)
        if rc != 0:
            raise self._fail(symbol, rc, job)
        out_logprobs[~want] = 0.0
        return out_tokens, out_logprobs

    def _copy_out(self, blocks: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(blocks, dtype=np.int32)
        out = np.empty((ids.size, self.block_size, self.block_token_bytes), dtype=np.uint8)
        rc = self._lib.simpler_kv_copy_out(self.chip_id, _ptr(ids), int(ids.size), _ptr(out), out.nbytes)
        if rc != 0:
            raise BackendError(f"simpler_kv_copy_out on chip {self.chip_id} failed: {_STATUS.get(rc, rc)} ({rc})")
        return out

    def _copy_in(self, blocks: np.ndarray, data: np.ndarray) -> None:
        ids = np.ascontiguousarray(blocks, dtype=np.int32)
        src = np.ascontiguousarray(data, dtype=np.uint8)
        rc = self._lib.simpler_kv_copy_in(self.chip_id, _ptr(ids), int(ids.size), _ptr(src), src.nbytes)
        if rc != 0:
            raise BackendError(f"simpler_kv_copy_in on chip {self.chip_id} failed: {_STATUS.get(rc, rc)} ({rc})")

    # -- KV block ops ------------------------------------------------------------------

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        src, dst = check_copy_pair(src, dst, self.num_blocks)
        cache = self._kv_cache()
        if self.device_kv:  # through the host: the ABI has no device-side block copy
            self._copy_in(dst, self._copy_out(src))
            return
        cache[dst] = cache[src]

    def swap_out(self, blocks: np.ndarray) -> np.ndarray:
        """Copy of the blocks' bytes, shaped [n, block_size, block_token_bytes] uint8."""
        blocks = check_block_ids(blocks, self.num_blocks)
        cache = self._kv_cache()
        return self._copy_out(blocks) if self.device_kv else cache[blocks].copy()

    def swap_in(self, blocks: np.ndarray, data: np.ndarray) -> None:
        blocks = check_block_ids(blocks, self.num_blocks)
        cache = self._kv_cache()
        want = (blocks.size, self.block_size, self.block_token_bytes)
        if np.shape(data) != want:
            raise ValueError(f"swap_in data shape {np.shape(data)} != {want}")
        if self.device_kv:
            self._copy_in(blocks, data)
            return
        cache[blocks] = np.asarray(data, dtype=np.uint8)
