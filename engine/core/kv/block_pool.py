"""The physical KV block pool of one chip: free list, ref counts, quarantine.

A block is always in exactly one of three places: the free list, held (ref
count >= 0, owned by sequences and/or the prefix cache), or quarantine
(content unknown because a job that may still be writing it failed or timed
out). The pool never decides what a 0-ref held block becomes; `KvManager`
either parks it in the prefix cache or calls `free()`.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfBlocks(Exception):
    """Not enough allocatable blocks; the caller queues or preempts."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Stack: lowest ids first on a fresh pool; a freed block is reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_set: set[int] = set(self._free)
        self._refs: list[int] = [0] * num_blocks
        self._quarantine: set[int] = set()

    # -- queries -------------------------------------------------------------
    def num_free(self) -> int:
        return len(self._free)

    def num_quarantined(self) -> int:
        return len(self._quarantine)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refs[block]

    def is_free(self, block: int) -> bool:
        return block in self._free_set

    def is_quarantined(self, block: int) -> bool:
        return block in self._quarantine

    def quarantined(self) -> frozenset[int]:
        return frozenset(self._quarantine)

    def held(self) -> list[int]:
        """Blocks neither free nor quarantined (referenced or parked in a cache)."""
        return [b for b in range(self.num_blocks) if b not in self._free_set and b not in self._quarantine]

    # -- mutations -----------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._free_set.remove(b)
            assert self._refs[b] == 0
            self._refs[b] = 1
        return out

    def incref(self, block: int) -> None:
        self._check_held(block)
        self._refs[block] += 1

    def decref(self, block: int) -> int:
        self._check_held(block)
        if self._refs[block] <= 0:
            raise AssertionError(f"decref of block {block} with ref count 0")
        self._refs[block] -= 1
        return self._refs[block]

    def free(self, block: int) -> None:
        self._check_held(block)
        if self._refs[block] != 0:
            raise AssertionError(f"free of block {block} with ref count {self._refs[block]}")
        self._free.append(block)
        self._free_set.add(block)

    def quarantine(self, blocks: Iterable[int]) -> None:
        """Take held 0-ref blocks out of circulation until `release_quarantine()`."""
        for b in blocks:
            self._check_held(b)
            if self._refs[b] != 0:
                raise AssertionError(f"quarantine of block {b} still referenced ({self._refs[b]})")
            self._quarantine.add(b)

    def release_quarantine(self) -> list[int]:
        """After chip recovery: every quarantined block becomes allocatable again."""
        out = sorted(self._quarantine)
        self._quarantine.clear()
        for b in out:
            self._free.append(b)
            self._free_set.add(b)
        return out

    # -- checks --------------------------------------------------------------
    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} out of range 0..{self.num_blocks - 1}")

    def _check_held(self, block: int) -> None:
        self._check_id(block)
        if block in self._free_set:
            raise AssertionError(f"block {block} is on the free list")
        if block in self._quarantine:
            raise AssertionError(f"block {block} is quarantined")

    def check_invariants(self) -> None:
        if len(self._free) != len(self._free_set):
            raise AssertionError("free list holds a duplicate block")
        if self._free_set & self._quarantine:
            raise AssertionError("a block is both free and quarantined")
        for b in self._free_set | self._quarantine:
            if self._refs[b] != 0:
                raise AssertionError(f"free/quarantined block {b} has ref count {self._refs[b]}")
