"""GGUF model packages: a folder with manifest.json, model.gguf and golden.json.

The manifest pins the sha256 of the GGUF and of the golden cases, and the
sha256 of manifest.json is the package identity, as for the `.npz`
packages of the `ref` backend (`workers.model_package`; the rules both kinds
share are `workers.package_manifest`'s). The model itself
is whatever llama.cpp can load; the manifest records what npuserve needs
without opening it (vocabulary size, BOS/EOS ids, context length, chat
template, tokenizer kind) and the serving defaults (block size, KV pool,
batch profiles). `workers.package_loader.load_package` dispatches here when
the manifest says `"format": "gguf"`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from workers.package_manifest import (GOLDEN, MANIFEST, PackageFacts, check_manifest, common_fields, is_int, need,
                                      verify_listed_files)
from workers.package_manifest import write_manifest as write_package_manifest

FORMAT = "gguf"
GGUF_FILE = "model.gguf"
KV_SHAPE_KEYS = ("layers", "kv_heads", "key_length", "value_length")
TOKENIZER_KINDS = ("bytes", "gguf")


@dataclass(frozen=True, kw_only=True)
class GgufPackage(PackageFacts):
    architecture: str  # the GGUF's general.architecture (llama, gemma3, ...)
    context_length: int  # what the model was trained for (GGUF metadata)
    tokenizer: dict
    kv_shape: dict | None = None  # {"layers", "kv_heads", "key_length", "value_length"}; None in older packages

    @property
    def gguf_path(self) -> str:
        return os.path.join(self.path, GGUF_FILE)


def is_gguf_manifest(manifest) -> bool:
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def check_gguf_manifest(m, where: str) -> None:
    """The shared manifest rules, then the GGUF kind's: architecture, context length, tokenizer, KV shape, files."""
    check_manifest(m, where, ints=("context_length",), min_max_seq=2)
    need(isinstance(m.get("architecture"), str) and m["architecture"], where, "architecture must be a string")
    tok = m.get("tokenizer")
    need(isinstance(tok, dict) and tok.get("kind") in TOKENIZER_KINDS, where,
         f"tokenizer must be an object whose kind is one of {TOKENIZER_KINDS}")
    shape = m.get("kv_shape")
    need(shape is None or (isinstance(shape, dict) and set(shape) == set(KV_SHAPE_KEYS)
                           and all(is_int(v) and v > 0 for v in shape.values())), where,
         f"kv_shape must be an object of positive integers {', '.join(KV_SHAPE_KEYS)}")
    need(set(m["files"]) == {GGUF_FILE, GOLDEN}, where, f"files must list exactly {GGUF_FILE} and {GOLDEN}")


def load_gguf_package(path: str, manifest: dict, raw: bytes, verify_files: bool = True) -> GgufPackage:
    """Verify a GGUF package whose manifest.json (`raw`, parsed as `manifest`) was read already.

    `verify_files` False: the files were verified for this load already (by the daemon)."""
    check_gguf_manifest(manifest, os.path.join(path, MANIFEST))
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
