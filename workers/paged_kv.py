"""The paged KV cache of the `ref` backend: one chip's device KV memory.

Layout: K and V are each [layers, num_blocks, block_size, kv_heads, head_dim]
float32, so a block id addresses the same slice in every layer and a block
can be copied, swapped or shared as one unit. The scheduler owns allocation;
this class only stores, copies and moves what it is told to.

Host (swap) format of `swap_out`: [n_blocks, 2, layers, block_size,
kv_heads, head_dim] float32, index 0 = K, 1 = V; `swap_in` takes it back.
"""

from __future__ import annotations

import numpy as np

from ipc.kv_checksum import copy_rows
from ipc.kv_slots import ScatteredRows


class PagedKvCache:
    def __init__(self, *, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> None:
        if min(layers, num_blocks, block_size, kv_heads, head_dim) <= 0:
            raise ValueError("every KV cache dimension must be positive")
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        self._kv = np.zeros((2,) + shape, dtype=np.float32)  # one buffer: a block's rows are offsets into it
        self.k, self.v = self._kv[0], self._kv[1]
        self.layers = layers
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block in the host swap format."""
        return (2,) + self.k.shape[:1] + self.k.shape[2:]

    def write(self, layer: int, block_ids: np.ndarray, offsets: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store K/V [T, kv_heads, head_dim] of T tokens at (block_ids[t], offsets[t])."""
        self.k[layer, block_ids, offsets] = k
        self.v[layer, block_ids, offsets] = v

    def gather(self, layer: int, tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K, V [n, M*block_size, kv_heads, head_dim] of n lanes' block tables [n, M].

        -1 padding reads block 0; the caller masks every key past a lane's context.
        """
        safe = np.maximum(tables, 0)
        n, m = safe.shape
        k = self.k[layer][safe].reshape(n, m * self.block_size, *self.k.shape[3:])
        v = self.v[layer][safe].reshape(n, m * self.block_size, *self.v.shape[3:])
        return k, v

    def check_blocks(self, blocks: np.ndarray, what: str) -> np.ndarray:
        b = np.asarray(blocks)
        if b.ndim != 1 or (b.size and b.dtype.kind not in "iu"):
            raise ValueError(f"{what}: expected a 1-D integer array of block ids")
        b = b.astype(np.int64)
        if b.size and (b.min() < 0 or b.max() >= self.num_blocks):
            raise ValueError(f"{what}: block id outside 0..{self.num_blocks - 1}")
        return b

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """dst[i] <- src[i] for all i at once (sources are read before any destination is written)."""
        s = self.check_blocks(src, "copy_blocks src")
        t = self.check_blocks(dst, "copy_blocks dst")
        if s.shape != t.shape:
            raise ValueError("copy_blocks: src and dst differ in length")
        if len(np.unique(t)) != len(t):
            raise ValueError("copy_blocks: a destination block appears twice")
        self.k[:, t] = self.k[:, s]
        self.v[:, t] = self.v[:, s]

    def swap_out(self, blocks: np.ndarray) -> np.ndarray:
        b = self.check_blocks(blocks, "swap_out")
        out = np.empty((len(b),) + self.block_shape(), dtype=np.float32)
        flat = out.reshape(-1).view(np.uint8)
        for j, cache in enumerate((self.k, self.v)):
            dev, host = self._row_offsets(b, j)
            if not copy_rows(cache.reshape(-1).view(np.uint8), dev, self._row_bytes, flat, host):
                for layer in range(self.layers):  # per layer: a row gather, no transposed temporary
                    out[:, j, layer] = cache[layer][b]
        return out

    def host_rows(self, blocks: np.ndarray) -> ScatteredRows:
        """Blocks' swap format as rows in place (part (j, layer) of a block: one layer of K or V), no copy:
        a transfer gathers them straight into host slots (ipc.kv_slots.KvSlotPool.write_many)."""
        b = self.check_blocks(blocks, "host_rows")
        row = self._row_bytes
        jl = np.arange(2 * self.layers, dtype=np.int64)  # j * layers + layer, the swap format's order
        offs = (jl[None, :] * self.num_blocks + b[:, None]) * row
        return ScatteredRows(self._kv.reshape(-1).view(np.uint8), offs, row)

    @property
    def _row_bytes(self) -> int:
        return int(np.prod(self.k.shape[2:])) * 4  # one layer of one block: contiguous in both formats

    def _row_offsets(self, b: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets of blocks b's rows of K (j=0) or V (j=1), in the cache and in the swap format."""
        layers = np.arange(self.layers, dtype=np.int64)
        row = self._row_bytes
        dev = (layers[None, :] * self.num_blocks + b[:, None]) * row
        host = ((np.arange(len(b), dtype=np.int64)[:, None] * 2 + j) * self.layers + layers[None, :]) * row
        return dev.reshape(-1), host.reshape(-1)

    def swap_in(self, blocks: np.ndarray, data: np.ndarray) -> None:
        b = self.check_blocks(blocks, "swap_in")
        expected = (len(b),) + self.block_shape()
        if tuple(data.shape) != expected:
            raise ValueError(f"swap_in: data shape {tuple(data.shape)}, expected {expected}")
        if len(np.unique(b)) != len(b):
            raise ValueError("swap_in: a block appears twice")
        data = np.ascontiguousarray(data, dtype=np.float32)
        flat = data.reshape(-1).view(np.uint8)
        for j, cache in enumerate((self.k, self.v)):
            dev, host = self._row_offsets(b, j)
            if not copy_rows(flat, host, self._row_bytes, cache.reshape(-1).view(np.uint8), dev):
                for layer in range(self.layers):
                    cache[layer][b] = data[:, j, layer]
