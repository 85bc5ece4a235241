"""Chain hashes of full KV blocks: the key a block keeps in the host and disk tiers.

A block's hash covers everything its KV depends on: the model and KV layout
(`root`), the tenant's prefix salt, and every token up to the end of the
block. Chained (h_i = H(h_{i-1}, tokens of block i)), so a prompt's hashes
cost one short hash per block and equal prefixes give equal hashes on every
chip of the board and across restarts (unlike block ids or generation
numbers, which are local and restart at 1).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST = 16


def root_hash(model_tag: str, salt: str) -> bytes:
    """The hash "before" the first block: model + KV layout (`model_tag`) and the tenant salt."""
    return hashlib.blake2b(f"{model_tag}\0{salt}".encode(), digest_size=DIGEST).digest()


def extend_chain(chain: list[bytes], root: bytes, tokens: Sequence[int], block_size: int, n_blocks: int) -> list[bytes]:
    """Append to `chain` (the hashes of the first len(chain) blocks of `tokens`) up to `n_blocks`; returns it."""
    pack = struct.Struct(f"<{block_size}i").pack
    prev = chain[-1] if chain else root
    for i in range(len(chain), n_blocks):
        prev = hashlib.blake2b(prev + pack(*tokens[i * block_size:(i + 1) * block_size]),
                               digest_size=DIGEST).digest()
        chain.append(prev)
    return chain


def chain_of(root: bytes, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The hashes of every full block of `tokens`."""
    return extend_chain([], root, tokens, block_size, len(tokens) // block_size)
