"""Argument checks of the `ChipBackend` KV block operations (copy_blocks, swap_out, swap_in).

Backends that keep KV per block id (or pretend to, like the stub) must reject
the same bad ids with the same message, so they share these checks.
"""

from __future__ import annotations

import numpy as np


def check_block_ids(blocks: np.ndarray, num_blocks: int) -> np.ndarray:
    """`blocks` as a flat int64 array; ValueError if any id is outside [0, num_blocks)."""
    blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)
    if blocks.size and (blocks.min() < 0 or blocks.max() >= num_blocks):
        raise ValueError(f"block id out of range [0, {num_blocks})")
    return blocks


def check_copy_pair(src: np.ndarray, dst: np.ndarray, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of a copy_blocks call, each checked as above; ValueError if their lengths differ."""
    src, dst = check_block_ids(src, num_blocks), check_block_ids(dst, num_blocks)
    if src.shape != dst.shape:
        raise ValueError("src and dst differ in length")
    return src, dst
