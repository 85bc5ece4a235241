"""KV blocks out of and into llama.cpp: one block's cells as llama.cpp's per-sequence state.

llama.cpp keeps KV in cells tagged with (sequence ids, position), not in
blocks; it can serialise a whole *sequence* (`llama_state_seq_get_data_ext`)
and restore one (`..._set_data_ext`). A block of the scheduler is the cells
of one sequence at positions [k*bs, (k+1)*bs). So:

* export: copy those positions of the holding sequence into a scratch
  sequence (`llama_memory_seq_cp` with p0/p1: the cells are shared, not
  duplicated), serialise the scratch sequence, remove it. The state holds
  each cell's position, so a block keeps its absolute positions (RoPE is
  already applied to its keys).
* import: restore each block's state into the scratch sequence, check it
  holds the next whole block's positions, copy it into the destination
  sequence and remove the scratch. The backend decides what the run joins
  (a prefix from position 0 is a sequence of its own; a run that starts
  later waits for the lane that names the device blocks before it).

Flags 0 serialise every cache of the model: both Gemma 3's full-attention
cache and its sliding-window cache (the backend opens the context with
`swa_full`, so the sliding-window cache keeps every position until a cell
is reused). A block whose cells are not all there in every cache (e.g. a
sliding-window cell already reused for a later position) has a smaller
state than a whole block and is refused at export, never exported short.

A host-format row is `[u64 state bytes][state][zero padding]`, a whole
number of bytes per token (`row_bytes`), so it fits the board's fixed host
slots; the record around it (ipc.kv_slots) carries the layout tag and CRC.
"""

from __future__ import annotations

import numpy as np

from ipc.kv_slots import RecordRefused
from workers.backends.base import BackendError

FLAGS = 0  # every cache (full and sliding-window), data in host memory
LEN_BYTES = 8


class KvBlockIo:
    """Export / import of whole blocks of one llama.cpp context through one scratch sequence id."""

    def __init__(self, model, block_size: int, *, scratch: int, bos: int = 0) -> None:
        self.model, self.block_size, self.scratch = model, block_size, scratch
        self.state_bytes = self._probe(bos)
        self.bytes_per_token = -(-(LEN_BYTES + self.state_bytes) // block_size)
        self.row_bytes = self.bytes_per_token * block_size

    def _probe(self, bos: int) -> int:
        """The state size of one whole block: decode block_size tokens into the scratch sequence, measure,
        remove them (before any request, so the pool is empty again)."""
        m, bs, sc = self.model, self.block_size, self.scratch
        rc, _ = m.decode_in_place(np.full(bs, bos, np.int32), np.arange(bs, dtype=np.int32), np.full(bs, sc, np.int32),
                                  np.zeros(bs, np.int8))
        try:
            if rc != 0:
                raise BackendError(f"llamacpp backend: probing the KV block size: llama_decode returned {rc}")
            n = m.state_seq_size(sc, FLAGS)
        finally:
            m.seq_rm(sc, -1, -1)
        if n <= 0:
            raise BackendError("llamacpp backend: llama.cpp reports no sequence state")
        return n

    def export_block(self, sid: int, p0: int, row: np.ndarray) -> None:
        """Positions [p0, p0 + block_size) of sequence `sid` into `row` (row_bytes of uint8)."""
        m, sc = self.model, self.scratch
        p1 = p0 + self.block_size
        m.seq_rm(sc, -1, -1)
        m.seq_cp(sid, sc, p0, p1)
        try:
            if m.seq_pos_min(sc) != p0 or m.seq_pos_max(sc) != p1 - 1:
                raise BackendError(f"llamacpp backend: sequence {sid} no longer holds positions {p0}..{p1 - 1}")
            if m.state_seq_size(sc, FLAGS) != self.state_bytes:
                raise BackendError(f"llamacpp backend: positions {p0}..{p1 - 1} of sequence {sid} are not whole "
                                   f"in every cache (a sliding-window cell reused?): not exported")
            n = m.state_seq_get(sc, row[LEN_BYTES:LEN_BYTES + self.state_bytes], FLAGS)
            if n != self.state_bytes:
                raise BackendError(f"llamacpp backend: llama_state_seq_get_data wrote {n} of {self.state_bytes} bytes")
        finally:
            m.seq_rm(sc, -1, -1)
        row[:LEN_BYTES] = np.frombuffer(np.uint64(n).tobytes(), np.uint8)
        row[LEN_BYTES + n:] = 0

    def import_run(self, sid: int, rows: np.ndarray) -> int:
        """Rows of consecutive whole blocks into the empty sequence `sid`; returns the block index of the first
        (its positions say where it goes: a block keeps its absolute positions).

        RecordRefused (cause "layout" or "unsupported") when a row is not a whole block or not the next
        one; the caller then removes whatever reached `sid`."""
        m, sc, bs = self.model, self.scratch, self.block_size
        first = -1
        for i, row in enumerate(rows):
            if len(row) != self.row_bytes:
                raise RecordRefused("layout", f"llamacpp KV row of {len(row)} bytes, a block is {self.row_bytes}")
            n = int(np.frombuffer(row[:LEN_BYTES].tobytes(), np.uint64)[0])
            if n != self.state_bytes:
                raise RecordRefused("layout", f"llamacpp KV block state of {n} bytes, a whole block is "
                                              f"{self.state_bytes}")
            m.seq_rm(sc, -1, -1)
            try:
                if m.state_seq_set(sc, row[LEN_BYTES:LEN_BYTES + n], FLAGS) <= 0:
                    raise RecordRefused("layout", "llama_state_seq_set_data refused a KV block")
                lo, hi = m.seq_pos_min(sc), m.seq_pos_max(sc)
                if i == 0 and lo >= 0 and lo % bs == 0:
                    first = lo // bs
                if first < 0 or (lo, hi) != ((first + i) * bs, (first + i + 1) * bs - 1):
                    raise RecordRefused("unsupported", f"llamacpp KV import: block {i} of the run holds positions "
                                                       f"{lo}..{hi}, not the next whole block")
                m.seq_cp(sc, sid, -1, -1)
            finally:
                m.seq_rm(sc, -1, -1)
        return first
