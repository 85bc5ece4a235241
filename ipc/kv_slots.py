"""KV block records: one block's KV bytes with their layout and a checksum, in a host slot or a file.

The host tier of a board is one shared-memory segment of equal slots
(`KvSlotPool`): the daemon creates it, every chip worker attaches it, and a
transfer job names slots by index. A worker writes a slot when it exports a
block and checks it when it imports one. The same record, byte for byte, is
what a disk-tier block file holds (`encode_record` / `decode_record`), so a
block moves between tiers without being re-encoded.

A record refuses to be read as anything but what it is: its header carries
the layout tag (model weights, KV dtype, block size, layer/head shape, see
`layout_tag`) and a checksum of the payload with the algorithm that made it
(CRC-32C now; CRC-32 in records written before, still accepted; see
`ipc.kv_checksum`). A record of another layout, a torn
write or a flipped bit raises `RecordRefused` before any KV is written, so
the caller recomputes instead of serving wrong output.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

import numpy as np

from ipc.kv_checksum import ALGO_CRC32, ALGO_CRC32C, checksum, rows_crc32c
from ipc.shm import Segment

MAGIC = 0x4B56424C4B310A00  # "KVBLK1\n\0"
# magic u64, layout u64, payload bytes u64, checksum u32, checksum algorithm u32 (0 CRC-32, 1 CRC-32C), chain
# hash 16 bytes
_HEADER = struct.Struct("<QQQII16s")
HEADER_BYTES = 64
assert _HEADER.size <= HEADER_BYTES


class RecordRefused(ValueError):
    """A KV block record that must not be imported: empty, torn, corrupt, or of another layout."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause  # "empty" | "layout" | "checksum" | "truncated"


def layout_tag(model_sha256: str, dtype: str, block_size: int, num_layers: int, num_kv_heads: int,
               head_dim: int) -> int:
    """A 64-bit id of a KV layout: equal tags mean a block's bytes mean the same thing."""
    text = f"{model_sha256}|{dtype}|bs{block_size}|L{num_layers}|H{num_kv_heads}|D{head_dim}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def record_bytes(payload_bytes: int) -> int:
    """Size of one record (header + payload), rounded to 64 bytes so slots stay cache-line aligned."""
    return HEADER_BYTES + -(-payload_bytes // 64) * 64


def write_record(buf: memoryview, layout: int, payload: np.ndarray, chain: bytes = b"") -> None:
    """Fill `buf` (at least record_bytes(payload.nbytes) long) with one record.

    The header is written last, so a record torn by a crash mid-write fails
    its checksum or reads as empty.
    """
    data = np.ascontiguousarray(payload).view(np.uint8).reshape(-1)
    n = data.size
    if len(buf) < HEADER_BYTES + n:
        raise ValueError(f"record of {n} payload bytes does not fit {len(buf)} bytes")
    buf[:HEADER_BYTES] = bytes(HEADER_BYTES)  # invalid while the payload changes
    body = np.frombuffer(buf, np.uint8, n, HEADER_BYTES)
    body[:] = data
    crc = checksum(ALGO_CRC32C, body)
    buf[:_HEADER.size] = _HEADER.pack(MAGIC, layout, n, crc, ALGO_CRC32C, chain.ljust(16, b"\0")[:16])


def read_record(buf: memoryview, layout: int, chain: bytes | None = None) -> memoryview:
    """The payload of a valid record (a view of `buf`); RecordRefused otherwise."""
    if len(buf) < HEADER_BYTES:
        raise RecordRefused("truncated", f"record of {len(buf)} bytes has no header")
    magic, lay, n, crc, algo, ch = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise RecordRefused("empty", "no KV block record here (empty or torn)")
    if lay != layout:
        raise RecordRefused("layout", f"KV block of layout {lay:016x}, this chip's is {layout:016x}")
    if chain is not None and ch != chain.ljust(16, b"\0")[:16]:
        raise RecordRefused("chain", "KV block record of another prefix")
    if len(buf) < HEADER_BYTES + n:
        raise RecordRefused("truncated", f"KV block record truncated ({len(buf) - HEADER_BYTES} of {n} bytes)")
    body = buf[HEADER_BYTES:HEADER_BYTES + n]
    if algo not in (ALGO_CRC32, ALGO_CRC32C):
        raise RecordRefused("checksum", f"KV block record of an unknown checksum algorithm ({algo})")
    if checksum(algo, body) != crc:
        raise RecordRefused("checksum", "KV block record fails its checksum")
    return body


def encode_record(layout: int, payload: np.ndarray, chain: bytes = b"") -> bytes:
    out = bytearray(HEADER_BYTES + payload.nbytes)
    write_record(memoryview(out), layout, payload, chain)
    return bytes(out)


_EMPTY_HEADER = bytes(HEADER_BYTES)
# The header as a numpy record (the same bytes as _HEADER, padded to 64): many slots' headers in one pass.
_HEADER_DTYPE = np.dtype([("magic", "<u8"), ("layout", "<u8"), ("n", "<u8"), ("crc", "<u4"), ("algo", "<u4"),
                          ("chain", "u1", (16,)), ("rest", "u1", (HEADER_BYTES - _HEADER.size,))])
assert _HEADER_DTYPE.itemsize == HEADER_BYTES


class ScatteredRows(NamedTuple):
    """Records' payloads where they lie: row i is the parts buf[offsets[i, p]:... + part_bytes] in order
    (a device cache's block spread over its layers), so `write_many` copies them once, straight into slots."""

    buf: np.ndarray  # flat uint8
    offsets: np.ndarray  # [n, parts] int64 byte offsets
    part_bytes: int


def _chain_rows(chains) -> np.ndarray:
    """Chain hashes as [n, 16] uint8: a list of bytes (each padded or cut to 16), or such an array as is."""
    if isinstance(chains, np.ndarray):
        return chains.reshape(-1, 16)
    return np.frombuffer(b"".join(c.ljust(16, b"\0")[:16] for c in chains), np.uint8).reshape(-1, 16)


class KvSlotPool:
    """`slots` records of `slot_bytes` each in one shared-memory segment (the board's host KV tier)."""

    def __init__(self, seg: Segment, slots: int, slot_bytes: int) -> None:
        if slots <= 0 or slot_bytes < HEADER_BYTES or slots * slot_bytes > seg.size:
            raise ValueError(f"{slots} slots of {slot_bytes} bytes do not fit a segment of {seg.size}")
        self.seg = seg
        self.slots = slots
        self.slot_bytes = slot_bytes

    @classmethod
    def create(cls, prefix: str, board: str | int, slots: int, slot_bytes: int) -> "KvSlotPool":
        return cls(Segment.create(prefix, board, slots * slot_bytes, tag="kvh"), slots, slot_bytes)

    @classmethod
    def attach(cls, name: str, slots: int, slot_bytes: int, read_only: bool = False) -> "KvSlotPool":
        return cls(Segment.attach(name, read_only), slots, slot_bytes)

    @property
    def name(self) -> str:
        return self.seg.name

    def slot(self, i: int) -> memoryview:
        if not 0 <= i < self.slots:
            raise ValueError(f"host slot {i} outside 0..{self.slots - 1}")
        return self.seg.buf[i * self.slot_bytes:(i + 1) * self.slot_bytes]

    def payloads(self, nbytes: int) -> np.ndarray:
        """Every slot's payload as one [slots, nbytes] uint8 view (strided by the slot size)."""
        if HEADER_BYTES + nbytes > self.slot_bytes:
            raise ValueError(f"a payload of {nbytes} bytes does not fit a slot of {self.slot_bytes}")
        return np.ndarray((self.slots, nbytes), np.uint8, self.seg.buf, HEADER_BYTES, (self.slot_bytes, 1))

    def headers(self) -> np.ndarray:
        """Every slot's header as one [slots] record view (strided by the slot size)."""
        return np.ndarray((self.slots,), _HEADER_DTYPE, self.seg.buf, 0, (self.slot_bytes,))

    def _offsets(self, idx: np.ndarray) -> np.ndarray:
        if len(idx) and (idx.min() < 0 or idx.max() >= self.slots):
            raise ValueError(f"host slot outside 0..{self.slots - 1}")
        return idx * self.slot_bytes + HEADER_BYTES

    def write_many(self, slots: list[int], layout: int, rows: np.ndarray | ScatteredRows,
                   chains: list[bytes] | np.ndarray) -> None:
        """Records of rows[i] (contiguous [n, ...], or ScatteredRows) into slots[i]: headers cleared, payloads
        copied and summed in one pass, then the headers (so a record torn by a crash reads as empty)."""
        if isinstance(rows, ScatteredRows):
            src, src_off, part = rows.buf, rows.offsets, rows.part_bytes
            nbytes = rows.offsets.shape[1] * part
        else:
            data = np.ascontiguousarray(rows).view(np.uint8).reshape(len(slots), -1)
            nbytes = part = data.shape[1]
            src, src_off = data.reshape(-1), np.arange(len(slots), dtype=np.int64) * nbytes
        if len(src_off) != len(slots):
            raise ValueError(f"{len(src_off)} rows for {len(slots)} slots")
        if HEADER_BYTES + nbytes > self.slot_bytes:
            raise ValueError(f"a payload of {nbytes} bytes does not fit a slot of {self.slot_bytes}")
        idx = np.asarray(slots, np.int64)
        dst_off = self._offsets(idx)
        hv = self.headers()
        hv[idx] = np.zeros((), _HEADER_DTYPE)
        h = np.zeros(len(slots), _HEADER_DTYPE)
        h["crc"] = rows_crc32c(src, src_off, part, np.frombuffer(self.seg.buf, np.uint8), dst_off)
        h["magic"], h["layout"], h["n"], h["algo"] = MAGIC, layout, nbytes, ALGO_CRC32C
        h["chain"] = _chain_rows(chains)
        hv[idx] = h

    def read_many(self, slots: list[int], layout: int, chains: list[bytes] | np.ndarray, nbytes: int,
                  out: np.ndarray | None = None) -> np.ndarray:
        """The payloads of the records in `slots` ([n, nbytes] copy, into `out` when given: a C-contiguous
        uint8 array of that shape), each checked like `read_record` (RecordRefused naming the first bad
        one's cause). The checksums are of the bytes copied, so a slot overwritten meanwhile is caught."""
        idx = np.asarray(slots, np.int64)
        src_off = self._offsets(idx)
        h = self.headers()[idx]
        want = _chain_rows(chains)
        for cause, bad in (("empty", h["magic"] != MAGIC), ("layout", h["layout"] != layout),
                           ("chain", (h["chain"] != want).any(axis=1)), ("layout", h["n"] != nbytes)):
            if bad.any():
                raise RecordRefused(cause, f"host slot {slots[int(bad.argmax())]}: KV block record refused ({cause})")
        bad = (h["algo"] != ALGO_CRC32C) & (h["algo"] != ALGO_CRC32)
        if bad.any():
            raise RecordRefused("checksum", f"host slot {slots[int(bad.argmax())]}: KV block record of an unknown "
                                f"checksum algorithm ({int(h['algo'][bad.argmax()])})")
        if out is None:
            out = np.empty((len(slots), nbytes), np.uint8)
        elif out.shape != (len(slots), nbytes) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"read_many: out must be a C-contiguous uint8 [{len(slots)}, {nbytes}] array")
        rows = out
        crc = rows_crc32c(np.frombuffer(self.seg.buf, np.uint8), src_off, nbytes, rows.reshape(-1),
                          np.arange(len(slots), dtype=np.int64) * nbytes)
        for i in np.flatnonzero(h["algo"] == ALGO_CRC32).tolist():  # records written before CRC-32C
            crc[i] = checksum(ALGO_CRC32, rows[i])
        bad = crc != h["crc"]
        if bad.any():
            raise RecordRefused("checksum", f"host slot {slots[int(bad.argmax())]}: KV block record fails its checksum")
        return rows

    def write(self, i: int, layout: int, payload: np.ndarray, chain: bytes = b"") -> None:
        write_record(self.slot(i), layout, payload, chain)

    def read(self, i: int, layout: int) -> memoryview:
        return read_record(self.slot(i), layout)

    def raw(self, i: int) -> bytes:
        """The slot's whole record as bytes (what a disk-tier block file holds)."""
        s = self.slot(i)
        _, _, n, _, _, _ = _HEADER.unpack_from(s, 0)
        return bytes(s[:HEADER_BYTES + min(n, len(s) - HEADER_BYTES)])

    def put_raw(self, i: int, data: bytes) -> None:
        """Copy a record (from a block file) into a slot, header last."""
        s = self.slot(i)
        if len(data) > len(s):
            raise ValueError("record larger than a slot")
        s[:HEADER_BYTES] = bytes(HEADER_BYTES)
        s[HEADER_BYTES:len(data)] = data[HEADER_BYTES:]
        s[:HEADER_BYTES] = data[:HEADER_BYTES]

    def clear(self, i: int) -> None:
        self.slot(i)[:HEADER_BYTES] = bytes(HEADER_BYTES)

    def close(self) -> None:
        self.seg.close()

    def unlink(self) -> None:
        self.seg.unlink()
