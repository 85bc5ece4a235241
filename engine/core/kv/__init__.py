"""Per-chip paged KV bookkeeping: block pool, prefix cache, sequence manager.

Pure objects (no I/O, no clock): the scheduler owns one `KvManager` per chip
and drives it from its single-threaded loop.
"""

from __future__ import annotations

from engine.core.kv.block_pool import BlockPool, OutOfBlocks
from engine.core.kv.manager import KvManager, KvSequence, StaleJob
from engine.core.kv.prefix_cache import PrefixCache, PrefixKey
from engine.core.kv.states import KvSequenceState, KvStateError

__all__ = [
    "BlockPool",
    "KvManager",
    "KvSequence",
    "KvSequenceState",
    "KvStateError",
    "OutOfBlocks",
    "PrefixCache",
    "PrefixKey",
    "StaleJob",
]
