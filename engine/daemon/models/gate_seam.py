"""The load pipeline's package checks, behind one seam: resolve, verify, validate, capacity facts.

Each failure is a `GateFailure` naming the load step and the cause. The
verified package object is kept by the load and handed to what needs it later
(the daemon's tokenizer, the capacity plan), so one load hashes the package
once in the daemon.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.config import Config


class GateFailure(Exception):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step = step
        self.message = message


@dataclass(frozen=True)
class Facts:
    """What the capacity plan needs to know of a package (per worker)."""

    weights_bytes: int
    kv_block_bytes: int
    kv_num_blocks: int  # the package's default KV pool per chip


def resolve(root: str, package: str) -> str:
    """The package folder's real path; under `root` (symlinks resolved) when a root is configured."""
    if not package:
        raise GateFailure("resolve", "no package named")
    if root:
        real_root = os.path.realpath(root)
        path = os.path.realpath(os.path.join(real_root, package))
        if os.path.commonpath([real_root, path]) != real_root:
            raise GateFailure("resolve", f"package {package!r} resolves to {path}, outside the model root "
                                         f"{real_root} (symlinks included)")
    else:
        path = os.path.realpath(package)
    if not os.path.isdir(path):
        raise GateFailure("resolve", f"package {package!r}: no such package directory ({path})")
    return path


def verify(path: str):
    """Hash every file against the manifest (once per load); the verified package object."""
    from workers.model_package import PackageError, load_package

    try:
        return load_package(path)
    except PackageError as e:
        raise GateFailure("verify", str(e)) from None


def validate(pkg, cfg: Config) -> None:
    """The manifest against the configuration: profiles, max_seq, KV block size."""
    errors = []
    missing = [b for b in cfg.batch.profiles if b not in pkg.profiles]
    if missing:
        errors.append(f"batch.profiles {list(cfg.batch.profiles)}: the package declares profiles "
                      f"{sorted(pkg.profiles)}; {missing} not among them")
    if cfg.admission.max_prompt_tokens >= pkg.max_seq:
        errors.append(f"admission.max_prompt_tokens {cfg.admission.max_prompt_tokens}: must be < the package's "
                      f"max_seq ({pkg.max_seq})")
    if errors:
        raise GateFailure("validate", "; ".join(errors))


def facts(pkg, cfg: Config) -> Facts:
    """Bytes a worker holds for this package: its weight files and one KV block (K and V, all layers)."""
    files = pkg.manifest.get("files", {})
    weights = 0
    for name in files:
        if name.endswith((".npz", ".gguf", ".bin", ".safetensors")):
            try:
                weights += os.path.getsize(os.path.join(pkg.path, name))
            except OSError:
                pass
    dims = getattr(pkg, "dims", None)
    kv_block = 0
    if dims is not None:
        kv_block = 2 * dims.layers * dims.kv_heads * dims.head_dim * cfg.kv.block_size * 4
    return Facts(weights, kv_block, int(getattr(pkg, "kv_num_blocks", 0) or 0))
