"""The `sim` backend: stub tokens, delivered after the time a real NPU would take.

It lets the scheduler be studied as on hardware (batching windows, TTFT/TPOT
trade-offs) on a laptop. `time_scale` shrinks every delay uniformly (tests use
a small one); `busy_wait` spins instead of sleeping, to model a chip call that
holds the worker's CPU. By default the wait sleeps and then spins only its last
`spin_ms`: a plain sleep overshoots by ~0.5-1 ms on a loaded machine, which
would add 3-5 % to every 20 ms step and make the daemon look slower than the
latency model it is compared with.

The modelled device has a job queue, like an NPU with ping/pong engines
(`executor.max_inflight = 2`, docs/architecture.md): a job starts at the later
of its submission by the scheduler (`Job.submitted_ns`) and the modelled end
of the previous job, not when the worker's host code gets round to it. So the
worker's own per-job work (publishing the last result, reading the next job)
overlaps the next job's device time when the scheduler keeps two jobs in
flight, and adds to it when it keeps one -- as on hardware.

LoRA adapters: `lora_slots` device slots. An adapter is an npz adapter
package of the `.npz` model package the board runs (the sim takes that
package's shape, so the gate checks the adapter against it as for `ref`); the
sim reads only its manifest, never its tensors, and charges what the adapter
would cost the modelled model (`sim_lora.LoraCostModel`): per adapter lane of
a job, mixed adapters in one job, and a swap's copy into a slot.
"""

from __future__ import annotations

import time

import numpy as np

from ipc.records import Job, JobKind
import dataclasses

from workers.backends.base import BackendError, BackendInfo, KvTransferCost, StepOutput
from workers.backends.sim_latency import LatencyModel
from workers.backends.sim_lora import LoraCostModel
from workers.backends.stub import StubBackend


class SimBackend(StubBackend):
    name = "sim"

    def __init__(
        self,
        *,
        decode_base_ms: float = 18.0,
        decode_per_lane_ms: float = 0.12,
        flops_per_token: float = 2 * 7e9,
        throughput_flops: float = 312e12,
        prefill_base_ms: float = 0.0,
        host_ms: float = 0.0,
        busy_wait: bool = False,
        spin_ms: float = 1.5,
        time_scale: float = 1.0,
        # The modelled KV transfer (host link): a block of the modelled model's KV (7B, GQA, bf16, 16 tokens:
        # 2 MiB) over a 25 GB/s link, plus a fixed turnaround per transfer job.
        kv_block_bytes_model: int = 2 << 20,
        transfer_gbps: float = 25.0,
        transfer_base_ms: float = 0.05,
        # StubBackend's options, spelled out so inspect.signature() shows them (the daemon filters by it)
        vocab_size: int = 320,
        eos_ids: tuple[int, ...] = (257,),
        max_seq: int = 2048,
        block_size: int = 16,
        num_blocks: int = 4096,
        profiles: tuple[int, ...] = (1, 4, 8, 16),
        chip_id: int = 0,
        fail_job: int = 0,
        fail_chip: int = 0,
        # tensor parallelism: rank `tp_rank` of `tp_world` chips (the TP latency model; tokens are the
        # stub's, equal on every rank, so the sim needs no collective and ignores the group)
        tp_rank: int = 0,
        tp_world: int = 1,
        tp_group: str = "",
        tp_timeout_s: float = 30.0,
        layers: int = 32,
        allreduce_us: float = 20.0,
        # LoRA: device slots, and the extra launch a job with adapter lanes pays (sim_lora.LoraCostModel)
        lora_slots: int = 8,
        lora_step_ms: float = 0.3,
    ) -> None:
        super().__init__(vocab_size=vocab_size, eos_ids=eos_ids, max_seq=max_seq, block_size=block_size,
                         num_blocks=num_blocks, profiles=profiles, chip_id=chip_id, fail_job=fail_job,
                         fail_chip=fail_chip)
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.latency = LatencyModel(
            decode_base_ms=decode_base_ms,
            decode_per_lane_ms=decode_per_lane_ms,
            flops_per_token=flops_per_token,
            throughput_flops=throughput_flops,
            prefill_base_ms=prefill_base_ms,
            host_ms=host_ms,
            tp_degree=int(tp_world),
            layers=int(layers),
            allreduce_us=float(allreduce_us),
        )
        self.tp_rank, self.tp_world = int(tp_rank), int(tp_world)
        if spin_ms < 0:
            raise ValueError("spin_ms must be >= 0")
        self.busy_wait = bool(busy_wait)
        self.spin_s = spin_ms / 1000.0
        self._device_free_at = 0.0  # time.monotonic() at which the modelled device finishes its queue
        self.time_scale = float(time_scale)
        if transfer_gbps <= 0 or kv_block_bytes_model < 0 or transfer_base_ms < 0:
            raise ValueError("transfer_gbps must be > 0, kv_block_bytes_model and transfer_base_ms >= 0")
        self.transfer_base_s = transfer_base_ms / 1000.0
        self.transfer_s_per_block = kv_block_bytes_model / (transfer_gbps * 1e9)
        if lora_slots < 0:
            raise ValueError("lora_slots must be >= 0")
        self.lora = LoraCostModel(step_ms=lora_step_ms, transfer_gbps=transfer_gbps)
        self.adapter_sizes: list[int] = [0] * int(lora_slots)  # per device slot: rank x targets (0: empty)
        self.package = None

    def describe(self) -> BackendInfo:
        info = dataclasses.replace(super().describe(), kv_transfer=KvTransferCost(
            base_s=self.transfer_base_s * self.time_scale, per_block_s=self.transfer_s_per_block * self.time_scale,
            prefill_s_per_token=self.prefill_seconds(1) * self.time_scale))
        info.extra.update(
            latency=dict(self.latency.__dict__), time_scale=self.time_scale, busy_wait=self.busy_wait,
            spin_ms=self.spin_s * 1000.0, lora_cost=dict(self.lora.__dict__),
            lora={"slots": len(self.adapter_sizes) if self.tp_world == 1 else 0, "mixed": True},
        )
        return info

    def load(self, package) -> None:
        super().load(package)
        self.package = package  # the base an adapter is checked against

    # ---- LoRA adapters: the manifest only (rank, targets); the tensors are never read ----

    def read_adapter(self, path: str, sha256: str) -> int:
        """The adapter's size (rank x targets), after checking it fits the package the board runs."""
        from workers.lora.adapter_package import check_against_package, read_adapter_facts
        from workers.model_package import ModelPackage

        facts = read_adapter_facts(path)
        if sha256 and facts.sha256 != sha256:
            raise BackendError(f"{path}: manifest.json changed since the adapter was verified (sha256 differs)")
        if facts.format != "npz":
            raise BackendError(f"{path}: the sim backend serves npz adapters, not {facts.format}")
        if isinstance(self.package, ModelPackage):
            check_against_package(facts, self.package)
        return facts.rank * len(facts.targets)

    def load_adapter(self, slot: int, host_adapter: int) -> None:
        """A swap: the modelled copy into the slot occupies the device queue like a job."""
        if self.tp_world > 1:
            raise BackendError("sim backend: LoRA adapters are not served across tensor-parallel ranks")
        if not 0 <= slot < len(self.adapter_sizes):
            raise BackendError(f"sim backend: adapter slot {slot} outside 0..{len(self.adapter_sizes) - 1}")
        called = time.monotonic()
        end = max(called, self._device_free_at) + self.lora.load_seconds(int(host_adapter)) * self.time_scale
        self._device_free_at = end
        self._wait_until(end)
        self.adapter_sizes[slot] = int(host_adapter)

    def unload_adapter(self, slot: int) -> None:
        if 0 <= slot < len(self.adapter_sizes):
            self.adapter_sizes[slot] = 0

    def _lane_sizes(self, job: Job, lanes: np.ndarray) -> np.ndarray:
        """Each lane's adapter size (0: base); ValueError for a slot that holds no adapter."""
        if not job.adapter.size or not lanes.size:
            return np.zeros(len(lanes), np.int64)
        slot = np.asarray(job.adapter)[lanes].astype(np.int64)
        sizes = np.zeros(len(lanes), np.int64)
        for i, s in enumerate(slot):
            if s >= 0:
                if s >= len(self.adapter_sizes) or not self.adapter_sizes[s]:
                    raise ValueError(f"adapter slot {int(s)} holds no adapter")
                sizes[i] = self.adapter_sizes[s]
        return sizes

    # Modelled device time, before time_scale.
    def decode_seconds(self, active_lanes: int) -> float:
        return self.latency.decode_seconds(active_lanes)

    def prefill_seconds(self, n_tokens: int) -> float:
        return self.latency.prefill_seconds(n_tokens)

    def prefill(self, job: Job) -> StepOutput:
        called = time.monotonic()
        self._check(job, JobKind.PREFILL)
        valid = np.asarray(job.lane_valid) != 0
        lens = np.diff(np.asarray(job.query_start, dtype=np.int64))
        n_tokens = int(lens[valid].sum()) if job.batch else 0
        lanes = np.flatnonzero(valid)
        sizes = self._lane_sizes(job, lanes)
        lora = self.lora.prefill_seconds([(int(lens[lane]), int(z)) for lane, z in zip(lanes, sizes) if z],
                                         self.latency.throughput_flops) / self.latency.tp_degree
        out = StepOutput(tokens=self.sampled_tokens(job))
        self._wait_until(self._device_end(job, called, self.prefill_seconds(n_tokens) + lora))
        return out

    def decode(self, job: Job) -> StepOutput:
        called = time.monotonic()
        self._check(job, JobKind.DECODE)
        lanes = np.flatnonzero(job.lane_valid)
        sizes = self._lane_sizes(job, lanes)
        lora = self.lora.decode_seconds([int(z) for z in sizes if z]) / self.latency.tp_degree
        out = StepOutput(tokens=self.sampled_tokens(job))
        self._wait_until(self._device_end(job, called, self.decode_seconds(len(lanes)) + lora))
        return out

    def swap_out(self, blocks: np.ndarray) -> np.ndarray:
        out = super().swap_out(blocks)
        self._transfer_wait(out.shape[0])
        return out

    def swap_in(self, blocks: np.ndarray, data: np.ndarray) -> None:
        super().swap_in(blocks, data)
        self._transfer_wait(len(data))

    def _transfer_wait(self, n_blocks: int) -> None:
        """A transfer occupies the modelled device queue like a job (the worker orders it with compute)."""
        called = time.monotonic()
        end = max(called, self._device_free_at) + (self.transfer_base_s + n_blocks * self.transfer_s_per_block) \
            * self.time_scale
        self._device_free_at = end
        self._wait_until(end)

    def _device_end(self, job: Job, called: float, seconds: float) -> float:
        """When the modelled device finishes `job`: queued behind the previous job, from its submission."""
        arrived = min(job.submitted_ns / 1e9, called) if job.submitted_ns else called
        scale = self.time_scale
        host = self.latency.host_ms / 1000.0 * scale
        end = max(arrived + host, self._device_free_at) + seconds * scale
        self._device_free_at = end
        return end

    def _wait_until(self, deadline: float) -> None:
        if self.busy_wait:
            while time.monotonic() < deadline:
                pass
            return
        while (left := deadline - time.monotonic()) > self.spin_s:
            time.sleep(left - self.spin_s)
        while time.monotonic() < deadline:
            pass
