"""What LoRA adapters cost the simulated NPU: a job's low-rank products and an adapter's swap into a slot.

The `sim` backend models a 7B llama-like model (`sim_latency.LatencyModel`),
so the adapter costs are the ones of that model's matrices, scaled by each
adapter's rank and number of adapted targets (`rank x targets`, an adapter's
"size"): an adapted matrix of the modelled model is 4096 wide on either side
(in + out = 8192) in each of its 32 layers.

* Decode (the gather way, Punica's BGMV): lanes of any adapters share one job;
  the job pays one extra launch of the gathered shrink/expand kernels for all
  its adapter lanes, and each adapter lane reads its adapter's A and B
  (memory-bound: bytes over the device's bandwidth). Base lanes cost nothing.
* Prefill (segmented, SGMV): the same launch, plus the low-rank FLOPs of every
  adapter token at the model's sustained throughput.
* Swap: copying the adapter's A and B (bf16) over the host link into a device
  slot, plus a fixed turnaround; it occupies the device queue like a job.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraCostModel:
    step_ms: float = 0.3  # once per job with adapter lanes: the extra kernel launches of the low-rank products
    # per unit of adapter size (rank x targets), over the modelled 32 layers of in + out = 8192:
    bytes_per_rank: int = 32 * 8192 * 2  # A and B in bf16
    flops_per_rank: float = 2 * 32 * 8192  # per token
    device_gbps: float = 2000.0  # the device memory a decode lane's gather reads A and B from
    transfer_gbps: float = 25.0  # the host link a swap copies the adapter over
    load_base_ms: float = 0.2  # a swap's fixed turnaround

    def __post_init__(self) -> None:
        for name in ("step_ms", "bytes_per_rank", "flops_per_rank", "load_base_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"lora {name} must be >= 0")
        if self.device_gbps <= 0 or self.transfer_gbps <= 0:
            raise ValueError("lora device_gbps and transfer_gbps must be > 0")

    def decode_seconds(self, lane_sizes: list[int]) -> float:
        """The extra time of a decode job whose adapter lanes have these sizes (rank x targets; base lanes: none)."""
        if not lane_sizes:
            return 0.0
        return self.step_ms / 1000.0 + sum(lane_sizes) * self.bytes_per_rank / (self.device_gbps * 1e9)

    def prefill_seconds(self, token_sizes: list[tuple[int, int]], throughput_flops: float) -> float:
        """The extra time of a prefill job: (new tokens, adapter size) per adapter lane."""
        if not token_sizes:
            return 0.0
        flops = sum(n * size for n, size in token_sizes) * self.flops_per_rank
        return self.step_ms / 1000.0 + flops / throughput_flops

    def load_seconds(self, size: int) -> float:
        """Swapping an adapter of this size into a device slot."""
        return self.load_base_ms / 1000.0 + size * self.bytes_per_rank / (self.transfer_gbps * 1e9)
