"""ctypes binding to llama.cpp through the npuserve shim (`npl_shim.c`).

llama.cpp itself comes prebuilt in the pinned `xllamacpp` wheel
(`xllamacpp/xllamacpp.abi3.so` exports the whole C API); it is never
compiled here. The shim is compiled once by the system C compiler against
the pinned headers in `include/` (their sha256 is checked first) and cached,
keyed by the hash of its sources and of the library it links to. The build
writes a private temp file and renames it into place, so racing workers and
a concurrent `make venv` all end up loading one complete library.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import subprocess
import tempfile
import threading

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM_SOURCE = os.path.join(HERE, "npl_shim.c")
INCLUDE_DIR = os.path.join(HERE, "include")
ABI_VERSION = 5
XLLAMACPP_PIN = "2026.10.11549"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot be used here; the message says what to install or fix."""


def llama_library_path() -> str:
    """The prebuilt libllama shipped in the xllamacpp wheel."""
    spec = importlib.util.find_spec("xllamacpp")
    if spec is None or not spec.submodule_search_locations:
        raise LlamaCppUnavailable(
            f"the llamacpp backend needs the xllamacpp wheel: pip install 'npuserve[llamacpp]' "
            f"(xllamacpp=={XLLAMACPP_PIN}), or run `make venv`")
    path = os.path.join(list(spec.submodule_search_locations)[0], "xllamacpp.abi3.so")
    if not os.path.isfile(path):
        raise LlamaCppUnavailable(f"{path}: missing from the xllamacpp wheel (reinstall xllamacpp=={XLLAMACPP_PIN})")
    return path


def check_headers() -> None:
    """The committed llama.cpp headers must be the pinned ones (SHA256SUMS)."""
    with open(os.path.join(INCLUDE_DIR, "SHA256SUMS")) as f:
        for line in f:
            digest, name = line.split()
            with open(os.path.join(INCLUDE_DIR, name), "rb") as h:
                if hashlib.sha256(h.read()).hexdigest() != digest:
                    raise LlamaCppUnavailable(f"{INCLUDE_DIR}/{name}: does not match the pinned sha256 in SHA256SUMS")


def _cache_dir() -> str:
    from workers.default_package import cache_root

    return os.path.join(cache_root(), "llamacpp")


def shim_key(libllama: str) -> str:
    h = hashlib.sha256()
    for path in [SHIM_SOURCE] + sorted(os.path.join(INCLUDE_DIR, n) for n in os.listdir(INCLUDE_DIR)):
        with open(path, "rb") as f:
            h.update(f.read())
    st = os.stat(libllama)
    h.update(f"{os.path.realpath(libllama)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def build_shim(out_dir: str | None = None) -> str:
    """Compile the shim (if not cached) and return its path. Atomic and race-safe."""
    libllama = llama_library_path()
    check_headers()
    out_dir = out_dir or _cache_dir()
    os.makedirs(out_dir, exist_ok=True)
    final = os.path.join(out_dir, f"libnpl_shim-{shim_key(libllama)}.so")
    if os.path.isfile(final):
        return final
    fd, tmp = tempfile.mkstemp(prefix=".npl_shim-", suffix=".so", dir=out_dir)
    os.close(fd)
    cc = os.environ.get("CC", "cc")
    libdir = os.path.dirname(libllama)
    cmd = [cc, "-shared", "-fPIC", "-O2", "-std=c11", "-Wall", "-I", INCLUDE_DIR, SHIM_SOURCE, "-o", tmp,
           "-L", libdir, f"-l:{os.path.basename(libllama)}", f"-Wl,-rpath,{libdir}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise LlamaCppUnavailable(f"compiling the llama.cpp shim failed ({' '.join(cmd)}):\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.rename(tmp, final)
    except FileNotFoundError as e:
        raise LlamaCppUnavailable(f"no C compiler {cc!r}: install one (e.g. apt-get install gcc) or set CC") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


_P = ctypes.c_void_p
_I = ctypes.c_int
_I32 = ctypes.c_int32
_SIGS = {
    "npl_abi_version": (_I, []),
    "npl_set_log_level": (None, [_I]),
    "npl_open": (_P, [ctypes.c_char_p, _I, _I, _I, _I, _I, _I, _I, ctypes.c_char_p, _I]),
    "npl_close": (None, [_P]),
    "npl_describe": (_I, [_P, ctypes.POINTER(ctypes.c_int64), _I]),
    "npl_meta": (_I, [_P, ctypes.c_char_p, ctypes.c_char_p, _I]),
    "npl_is_eog": (_I, [_P, _I32]),
    "npl_decode": (_I, [_P, _I, _P, _P, _P, _P, _P, _P, _I]),
    "npl_logits": (ctypes.POINTER(ctypes.c_float), [_P]),
    "npl_seq_rm": (_I, [_P, _I32, _I32, _I32]),
    "npl_seq_cp": (None, [_P, _I32, _I32, _I32, _I32]),
    "npl_seq_pos_max": (_I32, [_P, _I32]),
    "npl_seq_pos_min": (_I32, [_P, _I32]),
    "npl_state_seq_get": (ctypes.c_int64, [_P, _I32, _P, ctypes.c_int64, ctypes.c_uint32]),
    "npl_state_seq_set": (ctypes.c_int64, [_P, _I32, _P, ctypes.c_int64, ctypes.c_uint32]),
    "npl_clear": (None, [_P]),
    "npl_tokenize": (_I, [_P, ctypes.c_char_p, _I, _P, _I, _I, _I]),
    "npl_piece": (_I, [_P, _I32, ctypes.c_char_p, _I, _I]),
    "npl_lora_load": (_P, [_P, ctypes.c_char_p, ctypes.c_char_p, _I]),
    "npl_lora_free": (None, [_P]),
    "npl_lora_set": (_I, [_P, _P]),
}


def shim() -> ctypes.CDLL:
    """The loaded shim library (built on first use)."""
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(build_shim())
            for name, (res, args) in _SIGS.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = res, args
            if lib.npl_abi_version() != ABI_VERSION:
                raise LlamaCppUnavailable("stale llama.cpp shim in the cache: remove it and retry")
            lib.npl_set_log_level(int(os.environ.get("NPUSERVE_LLAMA_LOG_LEVEL", "4")))
            _lib = lib
        return _lib


DESCRIBE_KEYS = ("n_vocab", "n_ctx", "n_ctx_train", "n_layer", "n_head", "n_head_kv", "n_embd", "n_seq_max",
                 "bos", "eos", "add_bos", "n_swa", "n_batch", "eot", "add_eos", "max_parallel_sequences")


class LlamaModel:
    """One llama.cpp model (and, unless vocab_only, one context). Not thread-safe."""

    def __init__(self, path: str, *, vocab_only: bool = False, n_ctx: int = 0, n_batch: int = 512,
                 n_ubatch: int = 512, n_seq_max: int = 1, n_threads: int = 1, per_sequence_kv: bool = False) -> None:
        """`per_sequence_kv`: llama.cpp server's cell layout (a stream of n_ctx / n_seq_max cells per
        sequence) instead of one shared pool. The backend never uses it (prefix copies need the shared
        pool); `npuserve bench-kv-layout` measures what the shared pool costs a prefill."""
        self._lib = shim()
        err = ctypes.create_string_buffer(512)
        if not os.path.isfile(path):
            raise LlamaCppUnavailable(f"{path}: no such GGUF file")
        self._h = self._lib.npl_open(os.fsencode(path), int(vocab_only), n_ctx, n_batch, n_ubatch, n_seq_max,
                                     n_threads, int(per_sequence_kv), err, len(err))
        if not self._h:
            raise LlamaCppUnavailable(f"{path}: {err.value.decode(errors='replace')}")
        self.path = path
        out = (ctypes.c_int64 * len(DESCRIBE_KEYS))()
        n = self._lib.npl_describe(self._h, out, len(DESCRIBE_KEYS))
        self.info = {k: int(out[i]) for i, k in enumerate(DESCRIBE_KEYS[:n])}
        self.n_vocab = self.info["n_vocab"]

    def close(self) -> None:
        if getattr(self, "_h", None):
            self._lib.npl_close(self._h)
            self._h = None

    def __del__(self) -> None:
        self.close()

    def _handle(self):
        if not self._h:
            raise LlamaCppUnavailable("llama.cpp model already closed")
        return self._h

    def meta(self, key: str | None) -> str | None:
        """A GGUF metadata value as a string (key None: the chat template), or None."""
        k = None if key is None else key.encode()
        n = self._lib.npl_meta(self._handle(), k, None, 0)
        if n < 0:
            return None
        buf = ctypes.create_string_buffer(n + 1)
        self._lib.npl_meta(self._h, k, buf, n + 1)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.npl_is_eog(self._handle(), int(token)))

    @staticmethod
    def _batch(tokens, pos, seq, want) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A decode's per-token inputs as the contiguous arrays the shim reads; ValueError when lengths differ."""
        tokens = np.ascontiguousarray(tokens, np.int32)
        pos = np.ascontiguousarray(pos, np.int32)
        seq = np.ascontiguousarray(seq, np.int32)
        want = np.ascontiguousarray(want, np.int8)
        if not (len(pos) == len(seq) == len(want) == len(tokens)):
            raise ValueError("decode: tokens, pos, seq and want differ in length")
        return tokens, pos, seq, want

    def decode(self, tokens: np.ndarray, pos: np.ndarray, seq: np.ndarray, want: np.ndarray,
               rows: np.ndarray | None = None, out: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """One llama_decode. Token i with want[i] set writes its logits to out[rows[i]].

        Without `rows`, wanted tokens fill rows 0, 1, ... in order; without
        `out`, a fresh [rows, n_vocab] float32 array is made. Returns (rc, out).
        """
        tokens, pos, seq, want = self._batch(tokens, pos, seq, want)
        if rows is None:
            rows = np.cumsum(want, dtype=np.int32) - 1
        rows = np.ascontiguousarray(rows, np.int32)
        n_out = int(rows[want != 0].max()) + 1 if want.any() else 0
        if out is None:
            out = np.empty((n_out, self.n_vocab), np.float32)
        if out.dtype != np.float32 or not out.flags.c_contiguous or out.shape[1] != self.n_vocab or out.shape[0] < n_out:
            raise ValueError("decode: out must be C-contiguous float32 [>= rows, n_vocab]")
        n = len(tokens)
        if len(rows) != n:
            raise ValueError("decode: tokens, pos, seq, want and rows differ in length")
        rc = self._lib.npl_decode(self._handle(), n, tokens.ctypes.data, pos.ctypes.data, seq.ctypes.data,
                                  want.ctypes.data, rows.ctypes.data, out.ctypes.data, self.n_vocab)
        return rc, out

    def decode_in_place(self, tokens: np.ndarray, pos: np.ndarray, seq: np.ndarray,
                        want: np.ndarray) -> tuple[int, np.ndarray | None]:
        """One llama_decode whose logits are not copied: (rc, read-only [wanted, n_vocab] view of llama.cpp's
        own output buffer, rows in batch order). The view is valid until the next decode or close."""
        tokens, pos, seq, want = self._batch(tokens, pos, seq, want)
        rc = self._lib.npl_decode(self._handle(), len(tokens), tokens.ctypes.data, pos.ctypes.data, seq.ctypes.data,
                                  want.ctypes.data, None, None, self.n_vocab)
        n_out = int(np.count_nonzero(want))
        if rc != 0 or n_out == 0:
            return rc, None
        view = np.ctypeslib.as_array(self._lib.npl_logits(self._handle()), shape=(n_out, self.n_vocab))
        view.flags.writeable = False
        return rc, view

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        return bool(self._lib.npl_seq_rm(self._handle(), seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self._lib.npl_seq_cp(self._handle(), src, dst, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        return int(self._lib.npl_seq_pos_max(self._handle(), seq))

    def seq_pos_min(self, seq: int) -> int:
        return int(self._lib.npl_seq_pos_min(self._handle(), seq))

    def state_seq_size(self, seq: int, flags: int = 0) -> int:
        """Bytes of the sequence's state (its KV cells in every cache) as state_seq_get would write them."""
        return int(self._lib.npl_state_seq_get(self._handle(), seq, None, 0, flags))

    def state_seq_get(self, seq: int, out: np.ndarray, flags: int = 0) -> int:
        """The sequence's state into `out` (contiguous uint8, large enough); bytes written (0: failed)."""
        if out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError("state_seq_get: out must be contiguous uint8")
        return int(self._lib.npl_state_seq_get(self._handle(), seq, out.ctypes.data, out.nbytes, flags))

    def state_seq_set(self, seq: int, data: np.ndarray, flags: int = 0) -> int:
        """Bytes from state_seq_get into `seq` (its cells are replaced); bytes read (0: llama.cpp refused)."""
        data = np.ascontiguousarray(data, np.uint8)
        return int(self._lib.npl_state_seq_set(self._handle(), seq, data.ctypes.data, data.nbytes, flags))

    def clear(self) -> None:
        self._lib.npl_clear(self._handle())

    # -- LoRA adapters (llama.cpp's adapter API: one set per context) --
    def lora_load(self, path: str) -> int:
        """A LoRA GGUF loaded for this model: an opaque adapter pointer (LlamaCppUnavailable when refused)."""
        err = ctypes.create_string_buffer(512)
        ptr = self._lib.npl_lora_load(self._handle(), os.fsencode(path), err, len(err))
        if not ptr:
            raise LlamaCppUnavailable(f"{path}: {err.value.decode(errors='replace')}")
        return ptr

    def lora_free(self, adapter: int) -> None:
        self._lib.npl_lora_free(adapter)

    def lora_set(self, adapter: int | None) -> None:
        """Every sequence of the following decodes runs under `adapter` (None: the base model)."""
        if self._lib.npl_lora_set(self._handle(), adapter) != 0:
            raise RuntimeError("llama_set_adapters_lora failed")

    def tokenize(self, text: str | bytes, *, add_special: bool, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        cap = len(data) + 8
        for _ in range(2):
            out = np.empty(cap, np.int32)
            n = self._lib.npl_tokenize(self._handle(), data, len(data), out.ctypes.data, cap, int(add_special),
                                       int(parse_special))
            if n >= 0:
                return out[:n].tolist()
            cap = -n
        raise LlamaCppUnavailable("llama_tokenize failed")

    def piece(self, token: int, *, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._lib.npl_piece(self._handle(), int(token), buf, len(buf), int(special))
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.npl_piece(self._h, int(token), buf, len(buf), int(special))
        return buf.raw[:n]
