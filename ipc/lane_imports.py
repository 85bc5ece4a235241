"""Host/disk-tier promotions carried inside a prefill job (`ipc.records.Job.imports`), and who depends on them.

A prompt whose prefix blocks sit in the host or disk tier needs them on the
chip before its prefill reads them. Sent as their own KV_IMPORT job, that is
one more round trip to the chip before the prefill may go; carried in the
prefill job, the worker writes them and then runs the prefill, in one.

Each imported block names the lane that depends on it (`lane`): the worker
checks every record of a lane (layout, length, checksum) before it writes
any, and a lane one of whose records is refused gets none of its blocks
written and is not run; the result says so per lane (`JobResult.refused`),
and the other lanes of the job run as usual. A worker announces that it
understands the field with `BackendInfo.extra["lane_imports"]`; a scheduler
sends it to no other worker (one that ignored it would prefill over
unwritten blocks), and sends the old KV_IMPORT job instead.

One ring array, `imports` int32 [K, 8]; row k is one block:
  lane, src (host slot, or -1 from disk), dst (device block), where (HOST=1, DISK=2), chain hash (4 words).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ARRAY_NAME = "imports"
CAPABILITY = "lane_imports"  # BackendInfo.extra key a worker sets when it runs them
_COLS = 8


@dataclass
class LaneImports:
    rows: np.ndarray  # int32 [K, 8]

    @classmethod
    def build(cls, lanes: Sequence[int], src: Sequence[int], dst: Sequence[int], where: Sequence[int],
              chain_words: np.ndarray) -> "LaneImports":
        """Rows of K blocks; `chain_words` is int32 [4K] (the blocks' chain hashes, packed)."""
        k = len(lanes)
        assert len(src) == len(dst) == len(where) == k and chain_words.size == 4 * k
        rows = np.empty((k, _COLS), np.int32)
        rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3] = lanes, src, dst, where
        rows[:, 4:] = np.asarray(chain_words, np.int32).reshape(k, 4)
        return cls(rows)

    @classmethod
    def concat(cls, parts: Sequence["LaneImports"]) -> "LaneImports":
        return cls(np.concatenate([p.rows for p in parts]))

    def array_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {ARRAY_NAME: (self.rows.shape, "<i4")}

    def pack_into(self, dst) -> None:
        dst[ARRAY_NAME][...] = self.rows

    @classmethod
    def from_arrays(cls, a, copy: bool = True) -> "LaneImports":
        rows = a[ARRAY_NAME]
        return cls(np.array(rows) if copy else rows)

    def validate(self, batch: int) -> None:
        """Raise ValueError unless every row names a lane of the job and a known place."""
        r = self.rows
        if r.ndim != 2 or r.shape[1] != _COLS or r.dtype != np.int32:
            raise ValueError(f"imports must be int32 [K, {_COLS}]")
        if r.shape[0] and (r[:, 0].min() < 0 or r[:, 0].max() >= batch):
            raise ValueError("imports: a block names a lane outside the job")
        if r.shape[0] and not np.isin(r[:, 3], (1, 2)).all():
            raise ValueError("imports: a block's place must be HOST (1) or DISK (2)")

    def lanes(self) -> list[int]:
        """The lanes that depend on an import, in order of first appearance."""
        return list(dict.fromkeys(self.rows[:, 0].tolist()))

    def of_lane(self, lane: int) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray]:
        """(src, dst, where, chain words [4n]) of the blocks lane `lane` depends on."""
        r = self.rows[self.rows[:, 0] == lane]
        return r[:, 1].copy(), r[:, 2].copy(), r[:, 3].tolist(), np.ascontiguousarray(r[:, 4:]).reshape(-1)
