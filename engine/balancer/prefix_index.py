"""An approximate index of what each backend probably holds in its prefix cache.

The balancer cannot see a daemon's KV; it remembers what it routed there. A
prompt is cut into fixed-size blocks and each block is named by a hash chained
over all blocks before it (as the daemon's prefix cache keys them), so a hit
on block i implies the whole prefix up to i. Each backend keeps a bounded LRU
set of such hashes; eviction on the daemon is not seen, hence "approximate".
Text prompts (once the protocol carries them) use hashes of fixed-size
character chunks the same way (`text_block_hashes`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `tokens` (a partial last block is not cached by a daemon)."""
    out: list[int] = []
    h = 0
    for i in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[i:i + block_size])))
        out.append(h)
    return out


def text_block_hashes(text: str, chunk_chars: int) -> list[int]:
    """Chained hashes of fixed-size character chunks of a text prompt."""
    out: list[int] = []
    h = 0
    for i in range(0, len(text) - chunk_chars + 1, chunk_chars):
        h = hash((h, text[i:i + chunk_chars]))
        out.append(h)
    return out


class PrefixIndex:
    """Per-backend LRU sets of block hashes."""

    def __init__(self, capacity_blocks: int) -> None:
        assert capacity_blocks > 0
        self.capacity = capacity_blocks
        self._sets: dict[str, OrderedDict[int, None]] = {}

    def matched(self, backend: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt `backend` probably holds."""
        s = self._sets.get(backend)
        if not s:
            return 0
        n = 0
        for h in hashes:
            if h not in s:
                break
            n += 1
        return n

    def record(self, backend: str, hashes: Sequence[int]) -> None:
        s = self._sets.setdefault(backend, OrderedDict())
        for h in hashes:
            if h in s:
                s.move_to_end(h)
            else:
                s[h] = None
        while len(s) > self.capacity:
            s.popitem(last=False)

    def forget(self, backend: str) -> None:
        """A backend that died or was removed lost (or will lose) its cache."""
        self._sets.pop(backend, None)

    def size(self, backend: str) -> int:
        return len(self._sets.get(backend, ()))
