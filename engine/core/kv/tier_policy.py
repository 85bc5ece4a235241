"""When a KV move pays: promote a tier hit only when the transfer beats recomputing it.

The cost model comes from the backend (`BackendInfo.kv_transfer`: a
transfer job's turnaround, its cost per block, and a prompt token's compute
time). `mode` "always" and "never" exist for tests and for measuring the
model against the benchmark.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PromoteMode(str, enum.Enum):
    COST = "cost"
    ALWAYS = "always"
    NEVER = "never"


@dataclass(frozen=True)
class TransferCost:
    base_s: float = 2e-4
    per_block_s: float = 1e-5
    prefill_s_per_token: float = 0.0

    def transfer_s(self, n_blocks: int) -> float:
        return self.base_s + n_blocks * self.per_block_s

    def recompute_s(self, n_tokens: int) -> float:
        return n_tokens * self.prefill_s_per_token

    def break_even_blocks(self, block_size: int) -> float | None:
        """Fewest blocks whose promotion beats recomputing them (None: never)."""
        gain = block_size * self.prefill_s_per_token - self.per_block_s
        return None if gain <= 0 else self.base_s / gain


@dataclass(frozen=True)
class TierPolicy:
    mode: PromoteMode = PromoteMode.COST
    cost: TransferCost = TransferCost()

    def worth_promoting(self, n_blocks: int, block_size: int) -> bool:
        if n_blocks <= 0 or self.mode is PromoteMode.NEVER:
            return False
        if self.mode is PromoteMode.ALWAYS:
            return True
        return self.cost.transfer_s(n_blocks) < self.cost.recompute_s(n_blocks * block_size)
