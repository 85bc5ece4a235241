"""The transport's small C library (ipc/native/*.c): built at first use, loaded with ctypes, optional.

Why optional: it only makes two hot loops fast (the KV records' CRC-32C and the
tensor-parallel all-reduce's slot sum); each has a NumPy/library fallback with
the same results, used when no C compiler is present, the build fails, or
NPUSERVE_NATIVE=0 is set (tests compare both paths).

Built like the llama.cpp shim: compiled once per source hash into the npuserve
cache directory (NPUSERVE_CACHE_DIR, else $XDG_CACHE_HOME/npuserve), written
under a temporary name and renamed, so processes starting together never load
a half-written file. `make venv` builds it ahead of first use.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

SOURCES = tuple(sorted((Path(__file__).resolve().parent / "native").glob("*.c")))
FLAGS = ("-shared", "-fPIC", "-O3", "-std=c11", "-Wall")

_P, _SZ, _I, _I64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int64
_SIGS = {
    "npi_crc32c_hardware": (_I, []),
    "npi_crc32c_rows": (None, [_P, _P, _P, _P, _SZ, _SZ, _P]),
    "npi_crc32c_parts": (None, [_P, _P, _SZ, _P, _P, _SZ, _SZ, _P]),
    "npi_ar_sum": (None, [_P, _SZ, _I, _SZ, _P]),
    "npi_ar_shared": (_I, [_P, _SZ, _I, _I, _P, _SZ, _P, _P, _SZ, _SZ, _I64, _P, _I64, _P]),
    "npi_ar_step": (_I, [_P, _P, _P, _SZ, _I64]),
}

_loaded: ctypes.CDLL | None = None
_tried = False
why_not = ""  # why the library is not in use ("" when it is)


def cache_dir() -> str:
    root = os.environ.get("NPUSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "npuserve")
    return os.path.join(root, "native")


def source_key() -> str:
    h = hashlib.sha256(" ".join(FLAGS).encode())
    for p in SOURCES:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def build(out_dir: str | None = None) -> str:
    """Compile the library (if not cached) and return its path; RuntimeError when it cannot be built."""
    out_dir = out_dir or cache_dir()
    os.makedirs(out_dir, exist_ok=True)
    final = os.path.join(out_dir, f"libnpuserve_ipc-{source_key()}.so")
    if os.path.isfile(final):
        return final
    fd, tmp = tempfile.mkstemp(prefix=".npuserve_ipc-", suffix=".so", dir=out_dir)
    os.close(fd)
    cc = os.environ.get("CC", "cc")
    cmd = [cc, *FLAGS, "-o", tmp, *map(str, SOURCES)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.rename(tmp, final)
    except FileNotFoundError as e:
        raise RuntimeError(f"no C compiler {cc!r}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (see `why_not`) when the fallbacks must be used."""
    global _loaded, _tried, why_not
    if _tried:
        return _loaded
    _tried = True
    if os.environ.get("NPUSERVE_NATIVE", "1") == "0":
        why_not = "disabled by NPUSERVE_NATIVE=0"
        return None
    try:
        lib = ctypes.CDLL(build(), mode=ctypes.RTLD_LOCAL)
        for name, (res, args) in _SIGS.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
    except (RuntimeError, OSError, AttributeError) as e:
        why_not = str(e).splitlines()[0]
        return None
    _loaded = lib
    return lib


def reset() -> None:
    """Forget the loaded state, so the next use reads NPUSERVE_NATIVE again (tests switch paths)."""
    global _loaded, _tried, why_not
    _loaded, _tried, why_not = None, False, ""
