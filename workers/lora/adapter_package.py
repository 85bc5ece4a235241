"""The `.npz` LoRA adapter package (`ref`, `ctypes` backends): a folder like a model package.

    manifest.json   {"schema": "npuserve-lora/v1", "format": "npz", "name", "rank", "alpha",
                     "targets": ["wq", ...], "base": {"architecture", "layers", "name", "sha256"},
                     "files": {"adapter.npz": sha256}}
    adapter.npz     per layer i and target t: "layers.{i}.{t}.lora_a" [in, rank], "layers.{i}.{t}.lora_b" [rank, out]
    manifest.sig    optional detached signature of manifest.json (the model packages' scheme)

The adapted layer computes x @ (W + alpha / rank * A @ B). Every target is
adapted in every layer. `check_against_base` compares the adapter with the
base model (architecture, layer count, each target matrix's shape), reading
only the manifest and the npz headers, so an adapter for another base is
refused before any tensor is read; `read_adapter` then loads the tensors,
re-hashing the bytes it parses.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from dataclasses import dataclass, field

import numpy as np

from workers.model_package import ARCHITECTURE, ModelPackage
from workers.package_manifest import (MANIFEST, PackageError, is_int, need, read_manifest, read_pinned_npz,
                                      verify_listed_files)
from workers.transformer import weight_shapes

LORA_SCHEMA = "npuserve-lora/v1"
ADAPTER_FILE = "adapter.npz"
ADAPTER_FILES = {"npz": ADAPTER_FILE, "gguf": "adapter.gguf"}  # format -> its weights file
TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
MAX_RANK = 1024


def tensor_names(layer: int, target: str) -> tuple[str, str]:
    return f"layers.{layer}.{target}.lora_a", f"layers.{layer}.{target}.lora_b"


@dataclass(frozen=True)
class AdapterFacts:
    """A verified adapter manifest: what the adapter says about itself and its base."""

    path: str
    sha256: str  # of manifest.json: the adapter's identity (its KV differs from any other's)
    format: str  # "npz" (ref, ctypes) or "gguf" (llamacpp)
    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    base_architecture: str
    base_layers: int
    base_name: str = ""
    base_sha256: str = ""
    manifest: dict = field(default_factory=dict, repr=False)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_lora_manifest(m) -> bool:
    return isinstance(m, dict) and m.get("schema") == LORA_SCHEMA


def check_lora_manifest(m, where: str) -> None:
    need(isinstance(m, dict), where, "must be a JSON object")
    need(m.get("schema") == LORA_SCHEMA, where, f"unsupported schema {m.get('schema')!r} (expected {LORA_SCHEMA!r})")
    fmt = m.get("format", "npz")
    need(fmt in ADAPTER_FILES, where, f"format {fmt!r}: adapters are npz or gguf")
    need(is_int(m.get("rank")) and 0 < m["rank"] <= MAX_RANK, where, f"rank must be an integer in 1..{MAX_RANK}")
    alpha = m.get("alpha")
    need(isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and np.isfinite(alpha) and alpha > 0,
         where, "alpha must be a positive number")
    t = m.get("targets")
    need(isinstance(t, list) and t and all(x in TARGETS for x in t) and len(set(t)) == len(t), where,
         f"targets must be a non-empty list of distinct names among {list(TARGETS)}")
    base = m.get("base")
    need(isinstance(base, dict) and isinstance(base.get("architecture"), str) and is_int(base.get("layers"))
         and base["layers"] > 0, where, "base must name the base model's architecture and layer count")
    files = m.get("files")
    wfile = ADAPTER_FILES[fmt]
    need(isinstance(files, dict) and set(files) == {wfile}, where, f"files must list exactly {wfile}")
    digest = files[wfile]
    need(isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest), where,
         f"files[{wfile!r}] is not a sha256 hex digest")


def read_adapter_facts(path: str, verify_files: bool = True) -> AdapterFacts:
    """The adapter's manifest, checked, and (`verify_files`) every file's sha256; PackageError names the fault."""
    path = os.path.abspath(path)
    raw, m = read_manifest(path, "an adapter package")
    check_lora_manifest(m, os.path.join(path, MANIFEST))
    if verify_files:
        verify_listed_files(path, m["files"])
    base = m["base"]
    return AdapterFacts(path=path, sha256=hashlib.sha256(raw).hexdigest(), format=m.get("format", "npz"), name=str(m.get("name", os.path.basename(path))),
                        rank=m["rank"], alpha=float(m["alpha"]), targets=tuple(m["targets"]),
                        base_architecture=base["architecture"], base_layers=base["layers"],
                        base_name=str(base.get("name", "")), base_sha256=str(base.get("sha256", "")), manifest=m)


def npz_shapes(fpath: str) -> dict[str, tuple[int, ...]]:
    """{array name: shape} of an .npz, from the array headers only (no tensor data is read)."""
    out: dict[str, tuple[int, ...]] = {}
    try:
        with zipfile.ZipFile(fpath) as z:
            for info in z.infolist():
                if not info.filename.endswith(".npy"):
                    raise PackageError(f"{fpath}: member {info.filename!r} is not an .npy array")
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                        np.lib.format.read_array_header_2_0
                    shape, _fortran, dtype = read(f)
                if dtype.kind != "f":
                    raise PackageError(f"{fpath}: array {info.filename[:-4]!r} is {dtype}, not floating point")
                out[info.filename[:-4]] = tuple(int(x) for x in shape)
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise PackageError(f"{fpath}: not a readable .npz ({e})") from e
    return out


def expected_shapes(facts: AdapterFacts, base_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The adapter tensors' shapes for a base whose weight shapes are `base_shapes` (`weight_shapes`)."""
    out = {}
    for i in range(facts.base_layers):
        for t in facts.targets:
            w = base_shapes.get(f"layers.{i}.{t}")
            if w is None or len(w) != 2:
                raise PackageError(f"{facts.path}: the base model has no matrix layers.{i}.{t}")
            a, b = tensor_names(i, t)
            out[a], out[b] = (w[0], facts.rank), (facts.rank, w[1])
    return out


def check_against_package(facts: AdapterFacts, pkg: ModelPackage) -> None:
    """`check_against_base` for an npz model package: its architecture, layer count and matrix shapes."""
    check_against_base(facts, ARCHITECTURE, pkg.dims.layers, weight_shapes(pkg.dims, pkg.vocab_size))


def check_against_base(facts: AdapterFacts, architecture: str, layers: int,
                       base_shapes: dict[str, tuple[int, ...]]) -> None:
    """PackageError unless the adapter fits this base: architecture, layer count, every target matrix's shape.

    Reads the npz headers only: nothing is loaded for an adapter of another base."""
    where = os.path.join(facts.path, MANIFEST)
    need(facts.format == "npz", where, f"a {facts.format} adapter cannot adapt an npz model")
    need(facts.base_architecture == architecture, where,
         f"made for architecture {facts.base_architecture!r}, the base model is {architecture!r}")
    need(facts.base_layers == layers, where, f"made for {facts.base_layers} layers, the base model has {layers}")
    want = expected_shapes(facts, base_shapes)
    fpath = os.path.join(facts.path, ADAPTER_FILE)
    have = npz_shapes(fpath)
    missing = sorted(set(want) - set(have))
    if missing:
        raise PackageError(f"{fpath}: missing tensor {missing[0]!r}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise PackageError(f"{fpath}: unexpected tensor {extra[0]!r}")
    for name, shape in want.items():
        if have[name] != shape:
            raise PackageError(f"{fpath}: tensor {name!r} has shape {have[name]}, the base model needs {shape}")


@dataclass(frozen=True)
class LoraWeights:
    """An adapter's tensors in host memory: per (layer, target), A [in, r] and B [r, out] with alpha/r folded in."""

    sha256: str
    rank: int
    pairs: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())

    def merged_into(self, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The base weights with this adapter merged in (W + A @ B): the test oracle of the per-lane product."""
        out = dict(weights)
        for (i, t), (a, b) in self.pairs.items():
            key = f"layers.{i}.{t}"
            out[key] = (weights[key].astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
        return out


def read_adapter(facts: AdapterFacts) -> LoraWeights:
    """The tensors, re-hashed against the manifest as they are parsed (a file swapped since the check is refused)."""
    fpath = os.path.join(facts.path, ADAPTER_FILE)
    if facts.format != "npz":
        raise PackageError(f"{facts.path}: a {facts.format} adapter, not npz")
    arrays = read_pinned_npz(fpath, facts.manifest["files"][ADAPTER_FILE], "verification")
    pairs = {}
    scale = np.float32(facts.scale)
    for i in range(facts.base_layers):
        for t in facts.targets:
            an, bn = tensor_names(i, t)
            if an not in arrays or bn not in arrays:
                raise PackageError(f"{fpath}: missing tensor {an if an not in arrays else bn!r}")
            a, b = arrays[an], arrays[bn]
            if a.ndim != 2 or b.ndim != 2 or a.shape[1] != facts.rank or b.shape[0] != facts.rank:
                raise PackageError(f"{fpath}: {an}/{bn} are not [in, {facts.rank}] / [{facts.rank}, out]")
            if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
                raise PackageError(f"{fpath}: {an}/{bn} hold non-finite values")
            pairs[(i, t)] = (np.ascontiguousarray(a), np.ascontiguousarray(b * scale))
    return LoraWeights(sha256=facts.sha256, rank=facts.rank, pairs=pairs)


__all__ = ["ADAPTER_FILE", "LORA_SCHEMA", "TARGETS", "AdapterFacts", "LoraWeights", "check_against_base",
           "check_against_package", "check_lora_manifest", "expected_shapes", "is_lora_manifest", "npz_shapes",
           "read_adapter", "read_adapter_facts", "tensor_names"]
