"""KV_EXPORT / KV_IMPORT jobs in the worker: device blocks <-> host slots of the board's pool.

A transfer is a job of the chip's own ring, so the worker orders it with the
chip's compute: an export queued before a job that reuses its blocks reads
them first, and an import finishes before the job after it reads the blocks
it wrote. An import checks every record (layout, length, checksum) before it
writes one block: a refused import leaves the device KV untouched and is
answered INVALID, so the scheduler recomputes those tokens.
"""

from __future__ import annotations

import os

import numpy as np

from ipc.kv_slots import KvSlotPool, RecordRefused, encode_record, layout_tag, read_record
from ipc.records import Job, JobKind
from workers.backends.base import BackendInfo, ChipBackend

HOST = 1  # the values of a transfer job's `positions` (engine/core/tier_transfers.py)
DISK = 2
DIGEST = 16


def layout_of(info: BackendInfo) -> int:
    """The layout tag of a backend's KV blocks (ipc.kv_slots.layout_tag): records of another are refused."""
    kv = info.kv
    return layout_tag(info.model_sha256, kv.dtype, kv.block_size, kv.num_layers, kv.num_kv_heads,
                      kv.head_dim or kv.bytes_per_token)


def block_file(disk_dir: str, chain: bytes) -> str:
    """Where the disk tier keeps the block of this chain hash (disk_dir is already per KV layout)."""
    return os.path.join(disk_dir, chain.hex() + ".kv")


class _ChainList:
    """Row i of the [n, 16] chain hashes as bytes, made only when asked for (the disk tier's file names)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> bytes:
        return self.rows[i].tobytes()


class HostKv:
    """The worker's view of the board's host KV pool and of its own block format."""

    def __init__(self, pool: KvSlotPool | None, backend: ChipBackend, info: BackendInfo,
                 disk_dir: str | None = None) -> None:
        self.pool = pool
        self.disk_dir = disk_dir
        self.backend = backend
        self.layout = layout_of(info)
        probe = backend.swap_out(np.zeros(0, np.int32))  # [0, *block shape]: the host format of one block
        self.block_shape = tuple(probe.shape[1:])
        self.dtype = probe.dtype
        self.refused: dict[str, int] = {}  # imports refused, by cause

    def run(self, job: Job) -> None:
        """Carry out one transfer job; RecordRefused (nothing written) or any backend error propagates."""
        raw = np.ascontiguousarray(job.tokens, "<i4").view(np.uint8)
        if raw.size % DIGEST:
            raise ValueError("transfer job: one chain hash and one place per block")
        chain_rows = raw.reshape(-1, DIGEST)  # [n, 16]: the records' chain hashes, without a bytes object each
        where = job.positions.tolist()
        if len(chain_rows) != len(job.src_blocks) or len(where) != len(chain_rows):
            raise ValueError("transfer job: one chain hash and one place per block")
        chains = _ChainList(chain_rows)
        if job.kind == JobKind.KV_EXPORT:
            rows_in_place = getattr(self.backend, "swap_out_rows", None)
            if rows_in_place is not None and all(w == HOST for w in where):  # device -> slots in one pass
                self._pool().write_many(job.dst_blocks.tolist(), self.layout,
                                        rows_in_place(np.asarray(job.src_blocks)), chain_rows)
                return
            data = self.backend.swap_out(np.asarray(job.src_blocks))
            slots = job.dst_blocks.tolist()
            host = [i for i, w in enumerate(where) if w & HOST]
            if host:
                every = len(host) == len(where)
                self._pool().write_many(slots if every else [slots[i] for i in host], self.layout,
                                        data if every else data[host], chain_rows if every else chain_rows[host])
            for i, w in enumerate(where):
                if w & DISK:
                    self._write_file(chains[i], encode_record(self.layout, data[i], chains[i]))
            return
        assert job.kind == JobKind.KV_IMPORT
        self.import_blocks(job.src_blocks, job.dst_blocks, where, chain_rows)

    def import_blocks(self, src_blocks: np.ndarray, dst_blocks: np.ndarray, where: list[int],
                      chain_rows: np.ndarray) -> None:
        """Check every record, then write the blocks (host slots / disk files -> device blocks).

        RecordRefused: a record was bad and nothing was written. `chain_rows`: [n, 16] uint8.
        """
        chains = _ChainList(chain_rows)
        n_item = int(np.prod(self.block_shape, dtype=np.int64)) * self.dtype.itemsize
        rows = np.empty((len(chains), n_item), np.uint8)
        src = src_blocks.tolist()
        host = [r for r, w in enumerate(where) if w == HOST]
        try:
            if len(host) == len(chains):  # every record checked and gathered in one pass, into place
                self._pool().read_many(src, self.layout, chain_rows, n_item, out=rows)
            elif host:
                rows[host] = self._pool().read_many([src[r] for r in host], self.layout, [chains[r] for r in host],
                                                    n_item)
            for r, w in enumerate(where):
                if w != HOST:
                    body = read_record(memoryview(self._read_file(chains[r])), self.layout, chains[r])
                    if len(body) != n_item:
                        raise RecordRefused("layout", f"block {r}: {len(body)} bytes, a block is {n_item}")
                    rows[r] = np.frombuffer(body, np.uint8)
        except RecordRefused as e:  # nothing was written to the device
            self.refused[e.cause] = self.refused.get(e.cause, 0) + 1
            raise
        self.backend.swap_in(np.asarray(dst_blocks), rows.view(self.dtype).reshape(len(chains), *self.block_shape))

    def _pool(self) -> KvSlotPool:
        if self.pool is None:
            raise RecordRefused("missing", "no host KV pool attached")
        return self.pool

    def _write_file(self, chain: bytes, data: bytes) -> None:
        if self.disk_dir is None:
            raise ValueError("no disk tier directory")
        path = block_file(self.disk_dir, chain)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:  # whole or nothing under its name: a crash leaves a .tmp, never a torn block
            f.write(data)
        os.replace(tmp, path)

    def _read_file(self, chain: bytes) -> bytes:
        if self.disk_dir is None:
            raise RecordRefused("missing", "no disk tier directory")
        try:
            with open(block_file(self.disk_dir, chain), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise RecordRefused("missing", f"disk block {chain.hex()} is missing") from None
