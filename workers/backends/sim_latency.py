"""The latency model of a simulated NPU, as a pure function (its defaults: docs/backends.md, `sim`).

Shared by the `sim` backend (which sleeps for these durations) and the
in-process scheduler simulator (which advances a virtual clock by them), so
both study the same hardware. Decode is memory-bound: a fixed step cost plus
a small per-lane increment. Prefill is compute-bound: FLOPs / throughput.

Tensor parallelism (`tp_degree` chips per replica): each chip streams and
computes 1/degree of every layer, and each layer then pays two all-reduces
(after attention, after the MLP) of `allreduce_us` each. So a step costs
compute / degree + 2 x layers x allreduce_us: TP shortens a step (latency)
but spends `degree` chips on it, which is why independent replicas win
throughput once there are enough streams to fill them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyModel:
    decode_base_ms: float = 18.0  # one decode step, weights streamed once
    decode_per_lane_ms: float = 0.12  # each active lane's extra KV reads
    flops_per_token: float = 2 * 7e9  # ~2 FLOPs per parameter per token, 7B model
    throughput_flops: float = 312e12  # sustained FLOP/s (A100-class dense bf16)
    prefill_base_ms: float = 0.0  # fixed launch cost per prefill call; 0: a prefill is all compute
    # Per job, the host side of a step (the h2d copy of the inputs, the launch, d2h of the results) before
    # the compute can start. It runs beside the previous job's compute when the job was handed over early
    # (ping/pong, a queued next step), and adds to every step when the scheduler keeps one job in flight.
    host_ms: float = 0.0
    tp_degree: int = 1  # chips per replica the step is split across
    layers: int = 32  # transformer layers (each pays two all-reduces under TP)
    allreduce_us: float = 20.0  # one all-reduce of a step's activations between the replica's chips

    def __post_init__(self) -> None:
        if int(self.tp_degree) < 1 or int(self.layers) < 1:
            raise ValueError("tp_degree and layers must be >= 1")
        for name in ("decode_base_ms", "decode_per_lane_ms", "flops_per_token", "prefill_base_ms", "allreduce_us",
                     "host_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.throughput_flops <= 0:
            raise ValueError("throughput_flops must be > 0")

    def decode_seconds(self, active_lanes: int) -> float:
        """One decode step over `active_lanes` valid lanes (inactive lanes cost nothing)."""
        if active_lanes < 0:
            raise ValueError("active_lanes must be >= 0")
        return (self.decode_base_ms + self.decode_per_lane_ms * active_lanes) / 1000.0 / self.tp_degree \
            + self._collectives()

    def compute_start(self, arrived: float, device_free_at: float) -> float:
        """When a job handed over at `arrived` starts computing on a device free from `device_free_at`."""
        return max(arrived + self.host_ms / 1000.0, device_free_at)

    def prefill_seconds(self, n_tokens: int) -> float:
        """One prefill call over `n_tokens` new tokens."""
        if n_tokens < 0:
            raise ValueError("n_tokens must be >= 0")
        return (self.prefill_base_ms / 1000.0 + n_tokens * self.flops_per_token / self.throughput_flops) \
            / self.tp_degree + self._collectives()

    def _collectives(self) -> float:
        """Two all-reduces per layer under TP; none on one chip."""
        return 2 * self.layers * self.allreduce_us / 1e6 if self.tp_degree > 1 else 0.0
