"""GGUF model packages: a folder with manifest.json, model.gguf and golden.json.

The manifest pins the sha256 of the GGUF and of the golden cases, and the
sha256 of manifest.json is the package identity, as for the `.npz`
packages of the `ref` backend (`workers.model_package`). The model itself
is whatever llama.cpp can load; the manifest records what npuserve needs
without opening it (vocabulary size, BOS/EOS ids, context length, chat
template, tokenizer kind) and the serving defaults (block size, KV pool,
batch profiles). `load_package` dispatches here when the manifest says
`"format": "gguf"`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.model_package import (
    GOLDEN,
    MANIFEST,
    SCHEMA,
    common_fields,
    _is_int,
    _need,
    verify_listed_files,
)
from workers.model_package import write_manifest as write_package_manifest

FORMAT = "gguf"
GGUF_FILE = "model.gguf"
KV_SHAPE_KEYS = ("layers", "kv_heads", "key_length", "value_length")
TOKENIZER_KINDS = ("bytes", "gguf")


@dataclass(frozen=True)
class GgufPackage:
    path: str
    manifest: dict
    sha256: str  # sha256 of manifest.json: the package identity
    name: str
    architecture: str  # the GGUF's general.architecture (llama, gemma3, ...)
    vocab_size: int
    eos_ids: tuple[int, ...]
    bos_id: int
    pad_id: int
    max_seq: int
    block_size: int
    profiles: list[int]
    kv_num_blocks: int
    context_length: int  # what the model was trained for (GGUF metadata)
    tokenizer: dict
    golden_cases: list[dict] = field(repr=False, default_factory=list)
    kv_shape: dict | None = None  # {"layers", "kv_heads", "key_length", "value_length"}; None in older packages

    @property
    def gguf_path(self) -> str:
        return os.path.join(self.path, GGUF_FILE)

    def file_path(self, name: str) -> str:
        return os.path.join(self.path, name)

    def golden(self) -> list[dict]:
        return [dict(c, prompt=list(c["prompt"]), tokens=list(c["tokens"])) for c in self.golden_cases]


def is_gguf_manifest(manifest) -> bool:
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _check_manifest(m: dict, where: str) -> None:
    _need(m.get("schema") == SCHEMA, where, f"unsupported schema {m.get('schema')!r} (expected {SCHEMA!r})")
    _need(isinstance(m.get("architecture"), str) and m["architecture"], where, "architecture must be a string")
    for key in ("vocab_size", "bos_id", "pad_id", "max_seq", "block_size", "kv_num_blocks", "context_length"):
        _need(_is_int(m.get(key)) and m[key] >= 0, where, f"{key} must be a non-negative integer")
    v = m["vocab_size"]
    _need(v > 0 and m["max_seq"] > 1 and m["block_size"] > 0 and m["kv_num_blocks"] > 0, where,
          "vocab_size, max_seq, block_size and kv_num_blocks must be positive")
    _need(m["bos_id"] < v and m["pad_id"] < v, where, "bos_id/pad_id outside the vocabulary")
    eos = m.get("eos_ids")
    _need(isinstance(eos, list) and eos and all(_is_int(e) and 0 <= e < v for e in eos), where,
          "eos_ids must be a non-empty list of token ids inside the vocabulary")
    profiles = m.get("profiles")
    _need(isinstance(profiles, list) and profiles and all(
        isinstance(p, dict) and _is_int(p.get("batch")) and p["batch"] > 0
        and p.get("inactive_lane_policy", "mask") == "mask" for p in profiles), where,
        "profiles must be a non-empty list of {\"batch\": n, \"inactive_lane_policy\": \"mask\"}")
    _need(len({p["batch"] for p in profiles}) == len(profiles), where, "profiles repeat a batch size")
    tok = m.get("tokenizer")
    _need(isinstance(tok, dict) and tok.get("kind") in TOKENIZER_KINDS, where,
          f"tokenizer must be an object whose kind is one of {TOKENIZER_KINDS}")
    shape = m.get("kv_shape")
    _need(shape is None or (isinstance(shape, dict) and set(shape) == set(KV_SHAPE_KEYS)
                            and all(_is_int(v) and v > 0 for v in shape.values())), where,
          f"kv_shape must be an object of positive integers {', '.join(KV_SHAPE_KEYS)}")
    files = m.get("files")
    _need(isinstance(files, dict) and set(files) == {GGUF_FILE, GOLDEN}, where,
          f"files must list exactly {GGUF_FILE} and {GOLDEN}")
    for name, digest in files.items():
        _need(isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest),
              where, f"files[{name!r}] is not a sha256 hex digest")


def load_gguf_package(path: str, manifest: dict, raw: bytes, verify_files: bool = True) -> GgufPackage:
    """Verify a GGUF package whose manifest.json (`raw`, parsed as `manifest`) was read already.

    `verify_files` False: the files were verified for this load already (by the daemon)."""
    mpath = os.path.join(path, MANIFEST)
    _check_manifest(manifest, mpath)
    if verify_files:
        verify_listed_files(path, manifest["files"])
    return GgufPackage(**common_fields(path, manifest, raw), architecture=manifest["architecture"],
                       context_length=manifest["context_length"], tokenizer=dict(manifest["tokenizer"]),
                       kv_shape=dict(manifest["kv_shape"]) if manifest.get("kv_shape") else None)


def kv_shape_from_metadata(meta: Callable[[str], str | None]) -> dict | None:
    """The KV cache shape from GGUF metadata (`meta(key)` -> string or None), or None when it is incomplete.

    Recorded in the manifest (`kv_shape`) at import, so sizing a package's KV
    cache later needs no llama.cpp load (which costs seconds for a large vocabulary).
    """
    arch = meta("general.architecture")

    def num(key: str) -> int | None:
        v = meta(f"{arch}.{key}")
        return int(v) if v is not None and v.isdigit() else None

    layers, heads = num("block_count"), num("attention.head_count")
    kv_heads = num("attention.head_count_kv") or heads
    embd = num("embedding_length")
    key_length = num("attention.key_length") or (embd // heads if embd and heads else None)
    value_length = num("attention.value_length") or key_length
    shape = dict(layers=layers, kv_heads=kv_heads, key_length=key_length, value_length=value_length)
    return shape if arch and all(shape.values()) else None


def write_manifest(dir_: str, manifest: dict) -> None:
    """Add the files' sha256 to `manifest` and write it (the last file written)."""
    write_package_manifest(dir_, manifest, (GGUF_FILE, GOLDEN))
