""".npz model packages (the `ref` backend's): a folder with manifest.json, weights.npz and golden.json.

The manifest rules every package kind shares are `workers.package_manifest`'s;
this module adds the `.npz` kind's (architecture, dims, weights file) and
reads its weights. `workers.package_loader.load_package` verifies every hash,
and that nothing unlisted sits in the folder, before anything is used;
`weights()` re-verifies the bytes it actually parses, so a file swapped after
loading cannot slip through.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from workers.package_manifest import (
    GOLDEN,
    MANIFEST,
    PackageError,
    PackageFacts,
    check_manifest,
    common_fields,
    need,
    read_pinned_npz,
    verify_listed_files,
)
from workers.transformer import ModelDims, weight_shapes

ARCHITECTURE = "llama-like"
WEIGHTS = "weights.npz"
REQUIRED_FILES = (WEIGHTS, GOLDEN)


@dataclass(frozen=True, kw_only=True)
class ModelPackage(PackageFacts):
    dims: ModelDims

    @property
    def layers(self) -> int:
        return self.dims.layers

    @property
    def d_model(self) -> int:
        return self.dims.d_model

    @property
    def heads(self) -> int:
        return self.dims.heads

    @property
    def kv_heads(self) -> int:
        return self.dims.kv_heads

    @property
    def head_dim(self) -> int:
        return self.dims.head_dim

    def weights(self) -> dict[str, np.ndarray]:
        """The weight tensors, re-verified against the manifest hash and the dims."""
        fpath = self.file_path(WEIGHTS)
        arrays = read_pinned_npz(fpath, self.manifest["files"][WEIGHTS], "loading")
        expected = weight_shapes(self.dims, self.vocab_size)
        for name, shape in expected.items():
            if name not in arrays:
                raise PackageError(f"{fpath}: missing tensor {name!r}")
            if arrays[name].shape != shape:
                raise PackageError(f"{fpath}: tensor {name!r} has shape {arrays[name].shape}, expected {shape}")
        extra = sorted(set(arrays) - set(expected))
        if extra:
            raise PackageError(f"{fpath}: unexpected tensors {extra[:5]}")
        for name, a in arrays.items():
            if not np.all(np.isfinite(a)):
                raise PackageError(f"{fpath}: tensor {name!r} holds non-finite values")
        return arrays



def check_npz_manifest(m, where: str) -> None:
    """The shared manifest rules, then the `.npz` kind's: its architecture, valid dims, both files listed."""
    check_manifest(m, where)
    need(m.get("architecture") == ARCHITECTURE, where, f"unsupported architecture {m.get('architecture')!r}")
    need(isinstance(m.get("dims"), dict), where, "dims must be an object")
    try:
        dims = ModelDims.from_dict(m["dims"])
    except (TypeError, ValueError) as e:
        raise PackageError(f"{where}: bad dims: {e}") from e
    if "tp_degrees" in m:
        tp = m["tp_degrees"]
        need(isinstance(tp, list) and tp and all(isinstance(w, int) and not isinstance(w, bool) for w in tp)
             and set(tp) <= set(dims.tp_degrees()) and 1 in tp, where,
             f"tp_degrees must list degrees among {list(dims.tp_degrees())} (heads, KV heads and ffn_dim "
             "divide evenly), including 1")
    for name in REQUIRED_FILES:
        need(name in m["files"], where, f"files does not list {name}")


def load_npz_package(path: str, manifest: dict, raw: bytes, verify_files: bool = True) -> ModelPackage:
    """Verify an `.npz` package whose manifest.json (`raw`, parsed as `manifest`) was read already.

    `verify_files` False: the files were verified for this load already (by the daemon)."""
    check_npz_manifest(manifest, os.path.join(path, MANIFEST))
    if verify_files:
        verify_listed_files(path, manifest["files"])
    dims = ModelDims.from_dict(manifest["dims"])
    tp = tuple(sorted(manifest.get("tp_degrees", dims.tp_degrees())))
    return ModelPackage(**common_fields(path, manifest, raw), dims=dims, tp_degrees=tp)
