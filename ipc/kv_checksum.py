"""The checksums of KV block records: CRC-32C of many rows in one call, copying them on the way.

Why CRC-32C: the x86 (SSE4.2) and ARMv8 CPUs have an instruction for it, so
it runs near memory bandwidth, where zlib's CRC-32 ran at about 1 GB/s and
cost more than the copy it guarded. A record says which checksum it carries
(`ALGO_*`, the header word that was padding and always 0): records written
before CRC-32C (0, CRC-32) stay readable.

Two implementations with the same results: the C routine of
`ipc.native_lib` (four rows at a time on the CRC instruction, the copy fused
into the same pass, so the bytes are read once), and the `crc32c` package
row by row with NumPy copies, when the C library is unavailable.
"""

from __future__ import annotations

import zlib

import numpy as np

from ipc import native_lib

ALGO_CRC32 = 0  # zlib.crc32, the records written before CRC-32C
ALGO_CRC32C = 1
ALGOS = (ALGO_CRC32, ALGO_CRC32C)


def crc32c(data, value: int = 0) -> int:
    """CRC-32C by the `crc32c` package, imported at first use: importing it reads its version through
    importlib.metadata (~30 ms), which every daemon, worker and command would pay at start for checksums most
    of them never compute."""
    import crc32c as package

    return package.crc32c(data, value)


def checksum(algo: int, data) -> int:
    """One buffer's checksum by `algo`; ValueError for an algorithm this reader does not know."""
    if algo == ALGO_CRC32C:
        return crc32c(data)
    if algo == ALGO_CRC32:
        return zlib.crc32(data)
    raise ValueError(f"unknown checksum algorithm {algo}")


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def rows_crc32c(src: np.ndarray, src_off: np.ndarray, nbytes: int, dst: np.ndarray | None = None,
                dst_off: np.ndarray | None = None) -> np.ndarray:
    """CRC-32C of the rows src[src_off[i]:src_off[i] + nbytes] ([n] uint32), each copied to
    dst[dst_off[i]:...] as it is read when `dst` is given (so the sum is of the bytes copied).

    A row may be made of parts: src_off [n, parts], part p of row i at src_off[i, p] (nbytes each), the
    row's CRC over its parts in order, copied to dst[dst_off[i] + p * nbytes:...] (a gather: a block
    spread over the layers of a device cache into one record).
    `src`, `dst`: flat uint8 arrays (a segment's whole buffer, or contiguous rows); offsets are checked."""
    src_off = np.ascontiguousarray(src_off, np.int64)
    n, parts = (src_off.shape[0], src_off.shape[1]) if src_off.ndim == 2 else (len(src_off), 1)
    if src.ndim != 1 or src.dtype != np.uint8 or (n and (src_off.min() < 0 or src_off.max() + nbytes > src.size)):
        raise ValueError("rows_crc32c: a source row lies outside the source buffer")
    if dst is not None:
        dst_off = np.ascontiguousarray(dst_off, np.int64)
        if (dst.ndim != 1 or dst.dtype != np.uint8 or not dst.flags.writeable or dst_off.shape != (n,)
                or (n and (dst_off.min() < 0 or dst_off.max() + parts * nbytes > dst.size))):
            raise ValueError("rows_crc32c: a destination row lies outside the destination buffer")
    out = np.empty(n, np.uint32)
    if n == 0:
        return out
    lib = native_lib.library()
    if lib is not None:
        lib.npi_crc32c_parts(_ptr(src), _ptr(src_off), parts, None if dst is None else _ptr(dst),
                             None if dst is None else _ptr(dst_off), nbytes, n, _ptr(out))
        return out
    offs = src_off.reshape(n, parts).tolist()
    for i in range(n):
        crc = 0
        for p, o in enumerate(offs[i]):
            part = src[o:o + nbytes]
            if dst is not None:
                d = int(dst_off[i]) + p * nbytes
                dst[d:d + nbytes] = part
                part = dst[d:d + nbytes]  # the sum is of the bytes copied, as in the C path
            crc = crc32c(part, crc)
        out[i] = crc
    return out


def copy_rows(src: np.ndarray, src_off: np.ndarray, nbytes: int, dst: np.ndarray, dst_off: np.ndarray) -> bool:
    """Copy the rows as `rows_crc32c` does, without a checksum, in one C call; False (nothing copied) when
    the C library is unavailable, so the caller uses its own NumPy copy."""
    lib = native_lib.library()
    if lib is None:
        return False
    src_off = np.ascontiguousarray(src_off, np.int64)
    dst_off = np.ascontiguousarray(dst_off, np.int64)
    n = len(src_off)
    if (src.ndim != 1 or dst.ndim != 1 or src.dtype != np.uint8 or dst.dtype != np.uint8 or not dst.flags.writeable
            or len(dst_off) != n or (n and (src_off.min() < 0 or src_off.max() + nbytes > src.size
                                            or dst_off.min() < 0 or dst_off.max() + nbytes > dst.size))):
        raise ValueError("copy_rows: a row lies outside its buffer")
    if n:
        lib.npi_crc32c_rows(_ptr(src), _ptr(src_off), _ptr(dst), _ptr(dst_off), nbytes, n, None)
    return True


def native() -> bool:
    """Whether the C routine is in use (the benchmark prints which path it measured)."""
    return native_lib.library() is not None
