"""A GGUF file's header (scalar metadata and tensor shapes) read with `struct`, without the tensor data.

gguf's own reader parses every metadata array element into Python objects: on
Gemma 3 (a 262k-token vocabulary) that takes most of a minute, and the adapter
gate reads the base model's header on every load. This reader keeps scalars
and skips arrays (string arrays one length field at a time, others by size).
"""

from __future__ import annotations

import struct

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufHeaderError(ValueError):
    pass


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise GgufHeaderError("truncated GGUF header")
        (v,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if self.at + n > len(self.data):
            raise GgufHeaderError("truncated GGUF header")
        s = self.data[self.at:self.at + n]
        self.at += n
        return s.decode("utf-8", errors="replace")

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR:
            self.at += struct.calcsize(_SCALAR[vtype])
        elif vtype == _STRING:
            n = self.take("<Q")  # before the +=, which reads self.at first
            self.at += n
        elif vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALAR:
                self.at += struct.calcsize(_SCALAR[etype]) * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise GgufHeaderError(f"unknown GGUF value type {vtype}")


def read_gguf_header(path: str, chunk: int = 1 << 20) -> tuple[dict[str, object], dict[str, tuple[int, ...]]]:
    """({scalar metadata key: value}, {tensor name: ggml shape}) of the GGUF at `path`."""
    with open(path, "rb") as f:
        data = f.read(chunk)
        while True:
            try:
                return _parse(data)
            except GgufHeaderError:
                more = f.read(len(data))  # the header is longer than read so far: read more
                if not more:
                    raise
                data += more


def _parse(data: bytes) -> tuple[dict[str, object], dict[str, tuple[int, ...]]]:
    c = _Cursor(data)
    if data[:4] != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    c.at = 4
    version = c.take("<I")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    meta: dict[str, object] = {}
    for _ in range(n_kv):
        key, vtype = c.string(), c.take("<I")
        if vtype in _SCALAR:
            meta[key] = c.take(_SCALAR[vtype])
        elif vtype == _STRING:
            meta[key] = c.string()
        else:
            c.skip_value(vtype)
    shapes: dict[str, tuple[int, ...]] = {}
    for _ in range(n_tensors):
        name, n_dims = c.string(), c.take("<I")
        shapes[name] = tuple(c.take("<Q") for _ in range(n_dims))
        c.take("<I")  # type
        c.take("<Q")  # offset
    if c.at > len(data):
        raise GgufHeaderError("truncated GGUF header")
    return meta, shapes
