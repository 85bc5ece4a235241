"""The package gate: the checks `load` runs on a package before any worker starts (docs/models.md#the-package-gate).

    resolve    the package folder, realpath'd, must lie inside the configured model root
    signature  when a public key is configured: manifest.sig must be its Ed25519 signature of manifest.json
    verify     every file's sha256 against the manifest, nothing missing, nothing unlisted
               (workers.package_loader.load_package: one verification for .npz and GGUF packages)
    validate   the manifest against the config: format vs backend, batch profiles, KV layout, max_seq
    capacity   what the capacity plan needs (weight bytes, KV bytes per token and block, max_seq)

Each step that fails raises `PackageRefused(step, message)`; the message
names the file or key at fault. The functions are pure over the file system
(no globals, no sockets, no clock), so the daemon can run them on a worker
thread: hashing a 253 MB GGUF takes about a second.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass

from engine.config import Config, ConfigError, validate_against_model
from workers.gguf_package import GgufPackage, kv_shape_from_metadata
from workers.model_package import ModelPackage
from workers.package_loader import load_package
from workers.package_manifest import MANIFEST, PackageError
from workers.transformer import weight_shapes

STEPS = ("resolve", "signature", "verify", "validate", "capacity")
Package = ModelPackage | GgufPackage

# Which backends can serve which package format. stub/sim/ctypes ignore the
# weights of an .npz package (they take its shape: vocabulary, profiles,
# max_seq); only llama.cpp runs a GGUF.
FORMAT_BACKENDS: dict[str, tuple[str, ...]] = {
    "npz": ("ref", "sim", "stub", "ctypes"),
    "gguf": ("llamacpp",),
}
F32_BYTES = 4  # the ref backend keeps weights, K and V in float32 (workers/paged_kv.py)
LLAMACPP_KV_BYTES = 2  # llama.cpp's default K/V cache type is f16


class PackageRefused(Exception):
    """A package failed one gate step; `step` is one of STEPS, `message` names the cause."""

    def __init__(self, step: str, message: str) -> None:
        assert step in STEPS, step
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message


# ---- resolve ------------------------------------------------------------------------------------------

def resolve_package(model_root: str, name_or_path: str) -> str:
    """The real path of the package `name_or_path` (relative = to the root), which must lie inside `model_root`.

    Symlinks anywhere in the path are resolved first, so a link that leads
    out of the root is refused like a `..` or an absolute path outside it.
    `model_root` "" (none configured) takes the path as given, relative to
    the working directory: the board then trusts whoever may send admin ops.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise PackageRefused("resolve", "no package named")
    if "\0" in name_or_path:
        raise PackageRefused("resolve", "package name contains a NUL byte")
    if not model_root:
        return _package_folder(name_or_path, os.path.realpath(name_or_path))
    if ".." in name_or_path.replace("\\", "/").split("/"):
        raise PackageRefused("resolve", f"package {name_or_path!r}: '..' is not allowed in a package name")
    root = os.path.realpath(model_root)
    if not os.path.isdir(root):
        raise PackageRefused("resolve", f"model root {model_root} is not a directory")
    path = os.path.realpath(os.path.join(root, name_or_path))  # join keeps an absolute name as it is
    if os.path.commonpath([root, path]) != root:
        lexical = os.path.normpath(os.path.join(root, name_or_path))
        via = " through a symlink" if os.path.commonpath([root, lexical]) == root else ""
        raise PackageRefused("resolve", f"package {name_or_path!r} resolves to {path}{via}, outside the model "
                                        f"root {root}")
    if path == root:
        raise PackageRefused("resolve", f"package {name_or_path!r} is the model root itself; "
                                        f"name a package folder inside it")
    return _package_folder(name_or_path, path)


def _package_folder(name: str, path: str) -> str:
    if not os.path.isdir(path):
        raise PackageRefused("resolve", f"package {name!r}: no such package folder ({path})")
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        raise PackageRefused("resolve", f"{path}: not a model package (no {MANIFEST})")
    return path


# ---- signature + verify -------------------------------------------------------------------------------

def verify_package(path: str, public_key: str = "") -> Package:
    """The verified package at `path`: its signature (when `public_key`, a PEM path, is set) then every sha256.

    The signature is checked first, over the manifest bytes, and the loaded
    package must have been built from those very bytes (its identity is their
    sha256), so a manifest swapped between the two reads is refused too.
    """
    signed: bytes | None = None
    if public_key:
        from engine.daemon.models.package_signature import SignatureError, read_signed_manifest

        mpath = os.path.join(path, MANIFEST)
        try:
            signed = read_signed_manifest(public_key, path)
        except SignatureError as e:
            raise PackageRefused("signature", str(e)) from None
        except OSError as e:
            raise PackageRefused("verify", f"{mpath}: cannot read ({e.strerror})") from None
    try:
        pkg = load_package(path)
    except PackageError as e:
        raise PackageRefused("verify", str(e)) from None
    if signed is not None and pkg.sha256 != hashlib.sha256(signed).hexdigest():
        raise PackageRefused("signature", f"{os.path.join(path, MANIFEST)}: changed while it was being verified")
    return pkg


# ---- validate -----------------------------------------------------------------------------------------

def package_format(pkg: Package) -> str:
    return "gguf" if isinstance(pkg, GgufPackage) else "npz"


def effective_block_size(pkg: Package, cfg: Config) -> int:
    """Tokens per KV block as served: llama.cpp takes `kv.block_size`, the other backends the package's layout."""
    return cfg.kv.block_size if cfg.board.backend == "llamacpp" else pkg.block_size


def validate_package(pkg: Package, cfg: Config) -> None:
    """Refuse (step `validate`) a package this board's config cannot serve, naming every mismatch at once."""
    errors: list[str] = []
    fmt, backend = package_format(pkg), cfg.board.backend
    if backend not in FORMAT_BACKENDS[fmt]:
        other = [f for f, bs in FORMAT_BACKENDS.items() if backend in bs]
        errors.append(f"a {fmt} package needs backend {' or '.join(FORMAT_BACKENDS[fmt])}; this board runs "
                      f"{backend!r}, which serves {' or '.join(other) or 'no'} packages")
    try:
        validate_against_model(cfg, list(pkg.profiles), pkg.max_seq)
    except ConfigError as e:
        errors.extend(e.errors)
    bs = effective_block_size(pkg, cfg)
    if bs & (bs - 1):
        errors.append(f"KV layout: block_size {bs} is not a power of two")
    if pkg.max_seq < 2:
        errors.append(f"max_seq {pkg.max_seq}: must be at least 2")
    if errors:
        raise PackageRefused("validate", f"{pkg.path}: " + "; ".join(errors))


# ---- capacity -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CapacityFacts:
    """What one chip worker needs for a package under a config; the lifecycle core decides whether it fits."""

    format: str  # "npz" | "gguf"
    weight_bytes: int  # held by each worker
    kv_bytes_per_token: int  # K and V over all layers
    block_size: int  # tokens per KV block, as served
    kv_num_blocks: int  # KV blocks per chip, as served (kv.num_blocks, else the package's default)
    max_seq: int
    profiles: tuple[int, ...]

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_bytes_per_block * self.kv_num_blocks

    @property
    def worker_bytes(self) -> int:
        """Weights plus KV pool: one chip worker's share of the board's memory."""
        return self.weight_bytes + self.kv_pool_bytes

    def to_dict(self) -> dict:
        return {"format": self.format, "weight_bytes": self.weight_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token, "kv_bytes_per_block": self.kv_bytes_per_block,
                "block_size": self.block_size, "kv_num_blocks": self.kv_num_blocks,
                "kv_pool_bytes": self.kv_pool_bytes, "worker_bytes": self.worker_bytes,
                "max_seq": self.max_seq, "profiles": list(self.profiles)}


def _gguf_kv_shape(pkg: GgufPackage) -> dict:
    """The manifest's `kv_shape`; for packages imported before it was recorded, the GGUF metadata
    through a vocab-only llama.cpp load (seconds for a large vocabulary)."""
    if pkg.kv_shape:
        return pkg.kv_shape
    try:
        from workers.llamacpp.binding import LlamaModel
    except ImportError as e:
        raise PackageRefused("capacity", f"{pkg.gguf_path}: cannot read GGUF metadata without llama.cpp "
                                         f"(pip install 'npuserve[llamacpp]'): {e}") from None
    try:
        model = LlamaModel(pkg.gguf_path, vocab_only=True)
    except Exception as e:  # noqa: BLE001 - whatever llama.cpp reports, the package is unusable
        raise PackageRefused("capacity", f"{pkg.gguf_path}: llama.cpp cannot read it ({e})") from None
    try:
        shape = kv_shape_from_metadata(model.meta)
    finally:
        model.close()
    if shape is None:
        raise PackageRefused("capacity", f"{pkg.gguf_path}: GGUF metadata lacks block_count / attention.head_count"
                                         f"(_kv) / key_length: cannot size its KV cache")
    return shape


def capacity_facts(pkg: Package, cfg: Config) -> CapacityFacts:
    """Weight and KV sizes of `pkg` as `cfg` would serve it, per chip worker."""
    if isinstance(pkg, GgufPackage):
        shape = _gguf_kv_shape(pkg)  # K and V over all layers, f16
        per_token = shape["layers"] * shape["kv_heads"] * (shape["key_length"] + shape["value_length"]) \
            * LLAMACPP_KV_BYTES
        try:
            weights = os.path.getsize(pkg.gguf_path)  # llama.cpp maps the file: weights ~ its size
        except OSError as e:
            raise PackageRefused("capacity", f"{pkg.gguf_path}: cannot stat ({e.strerror})") from None
    else:
        d = pkg.dims
        per_token = 2 * d.layers * d.kv_heads * d.head_dim * F32_BYTES
        weights = sum(math.prod(s) for s in weight_shapes(d, pkg.vocab_size).values()) * F32_BYTES
    return CapacityFacts(format=package_format(pkg), weight_bytes=weights, kv_bytes_per_token=per_token,
                         block_size=effective_block_size(pkg, cfg),
                         kv_num_blocks=cfg.kv.num_blocks or pkg.kv_num_blocks,
                         max_seq=pkg.max_seq, profiles=tuple(sorted(pkg.profiles)))


# ---- all steps ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GatedPackage:
    """A package that passed the gate: its real path, the verified package object and its capacity facts."""

    path: str
    package: Package
    facts: CapacityFacts

    @property
    def sha256(self) -> str:
        return self.package.sha256


def gate_package(cfg: Config, model_root: str, name_or_path: str) -> GatedPackage:
    """resolve -> signature -> verify -> validate -> capacity facts; raises PackageRefused naming the step."""
    path = resolve_package(model_root, name_or_path)
    pkg = verify_package(path, cfg.model.signing_public_key)
    validate_package(pkg, cfg)
    return GatedPackage(path=path, package=pkg, facts=capacity_facts(pkg, cfg))
