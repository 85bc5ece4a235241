"""Model packages: a folder with manifest.json, weights.npz and golden.json.

The manifest pins the sha256 of every other file, and the sha256 of
manifest.json itself is the package identity (the model generation key), so
one hash names the exact weights and golden cases. `load_package` verifies
every hash, and that nothing unlisted sits in the folder, before anything is
used; `weights()` re-verifies the bytes it actually parses, so a file swapped
after loading cannot slip through.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np

from workers.transformer import ModelDims, weight_shapes

SCHEMA = "npuserve-model/v1"
ARCHITECTURE = "llama-like"
MANIFEST = "manifest.json"
WEIGHTS = "weights.npz"
GOLDEN = "golden.json"
SIGNATURE = "manifest.sig"  # optional detached signature of manifest.json (engine/daemon/models/package_signature.py)
REQUIRED_FILES = (WEIGHTS, GOLDEN)
# Bump when model_maker changes what a given default_model.json produces, so
# cached default packages built by older code are not reused.
MAKER_VERSION = 2  # 2: the manifest's tokenizer section is {"kind": ...}


class PackageError(Exception):
    """A package is missing, incomplete, tampered or malformed; the message names the file."""


@dataclass(frozen=True)
class ModelPackage:
    path: str
    manifest: dict
    sha256: str  # sha256 of manifest.json: the package identity
    name: str
    vocab_size: int
    eos_ids: tuple[int, ...]
    bos_id: int
    pad_id: int
    max_seq: int
    block_size: int
    profiles: list[int]
    kv_num_blocks: int
    dims: ModelDims
    golden_cases: list[dict] = field(repr=False, default_factory=list)

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

    def file_path(self, name: str) -> str:
        return os.path.join(self.path, name)

    def weights(self) -> dict[str, np.ndarray]:
        """The weight tensors, re-verified against the manifest hash and the dims."""
        fpath = self.file_path(WEIGHTS)
        try:
            with open(fpath, "rb") as f:
                data = f.read()
        except OSError as e:
            raise PackageError(f"{fpath}: cannot read ({e.strerror})") from e
        if hashlib.sha256(data).hexdigest() != self.manifest["files"][WEIGHTS]:
            raise PackageError(f"{fpath}: sha256 does not match the manifest (file changed after loading)")
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                arrays = {k: np.asarray(z[k], dtype=np.float32) for k in z.files}
        except Exception as e:  # noqa: BLE001 - any parse failure is a bad package
            raise PackageError(f"{fpath}: not a readable .npz ({e})") from e
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

    def golden(self) -> list[dict]:
        """[{"prompt": [...], "max_tokens": n, "tokens": [...]}]: greedy, EOS ignored."""
        return [dict(c, prompt=list(c["prompt"]), tokens=list(c["tokens"])) for c in self.golden_cases]


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise PackageError(f"{where}: {msg}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_manifest(m, where: str) -> None:
    _need(isinstance(m, dict), where, "must be a JSON object")
    _need(m.get("schema") == SCHEMA, where, f"unsupported schema {m.get('schema')!r} (expected {SCHEMA!r})")
    _need(m.get("architecture") == ARCHITECTURE, where, f"unsupported architecture {m.get('architecture')!r}")
    for key in ("vocab_size", "bos_id", "pad_id", "max_seq", "block_size", "kv_num_blocks"):
        _need(_is_int(m.get(key)) and m[key] >= 0, where, f"{key} must be a non-negative integer")
    v = m["vocab_size"]
    _need(v > 0 and m["max_seq"] > 0 and m["block_size"] > 0 and m["kv_num_blocks"] > 0, where,
          "vocab_size, max_seq, block_size and kv_num_blocks must be positive")
    _need(m["bos_id"] < v and m["pad_id"] < v, where, "bos_id/pad_id outside the vocabulary")
    eos = m.get("eos_ids")
    _need(isinstance(eos, list) and eos and all(_is_int(e) and 0 <= e < v for e in eos), where,
          "eos_ids must be a non-empty list of token ids inside the vocabulary")
    profiles = m.get("profiles")
    _need(isinstance(profiles, list) and profiles, where, "profiles must be a non-empty list")
    for p in profiles:
        _need(isinstance(p, dict) and _is_int(p.get("batch")) and p["batch"] > 0, where,
              f"bad profile {p!r}: needs a positive integer batch")
        _need(p.get("inactive_lane_policy", "mask") == "mask", where,
              f"profile {p!r}: unsupported inactive_lane_policy")
    batches = [p["batch"] for p in profiles]
    _need(len(set(batches)) == len(batches), where, "profiles repeat a batch size")
    _need(isinstance(m.get("dims"), dict), where, "dims must be an object")
    try:
        ModelDims.from_dict(m["dims"])
    except (TypeError, ValueError) as e:
        raise PackageError(f"{where}: bad dims: {e}") from e
    files = m.get("files")
    _need(isinstance(files, dict), where, "files must map file names to sha256 hex digests")
    for name, digest in files.items():
        _need(isinstance(name, str) and name and os.path.basename(name) == name and name not in (".", "..", MANIFEST, SIGNATURE),
              where, f"files lists an invalid file name {name!r}")
        _need(isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest),
              where, f"files[{name!r}] is not a sha256 hex digest")
    for name in REQUIRED_FILES:
        _need(name in files, where, f"files does not list {name}")


def _check_golden(cases, where: str, vocab: int, max_seq: int) -> None:
    _need(isinstance(cases, list), where, "must be a JSON list of cases")
    for i, c in enumerate(cases):
        ok = (
            isinstance(c, dict)
            and isinstance(c.get("prompt"), list) and c["prompt"]
            and isinstance(c.get("tokens"), list)
            and _is_int(c.get("max_tokens")) and c["max_tokens"] == len(c["tokens"]) > 0
            and all(_is_int(t) and 0 <= t < vocab for t in c["prompt"] + c["tokens"])
            and len(c["prompt"]) + c["max_tokens"] <= max_seq
        )
        _need(bool(ok), where, f"case {i} is malformed (prompt, max_tokens == len(tokens), ids in vocab)")


def verify_listed_files(path: str, files: dict[str, str]) -> None:
    """Every listed file present, regular and matching its sha256; nothing unlisted beside the manifest
    (and its optional detached signature, which cannot be listed in the manifest it signs)."""
    present = set(os.listdir(path))
    extra = sorted(present - set(files) - {MANIFEST, SIGNATURE})
    if extra:
        raise PackageError(f"{os.path.join(path, extra[0])}: file not listed in the manifest")
    for name, digest in sorted(files.items()):
        fpath = os.path.join(path, name)
        if name not in present:
            raise PackageError(f"{fpath}: missing (listed in the manifest)")
        if os.path.islink(fpath) or not os.path.isfile(fpath):
            raise PackageError(f"{fpath}: not a regular file")
        if file_sha256(fpath) != digest:
            raise PackageError(f"{fpath}: sha256 does not match the manifest")


def write_manifest(dir_: str, manifest: dict, names=None) -> None:
    """Pin the sha256 of `names` (default: the files `manifest` lists already) and write manifest.json.

    The one manifest writer of every package kind; written last, so a package
    whose manifest exists is complete.
    """
    names = sorted(manifest.get("files", {}) if names is None else names)
    manifest["files"] = {n: file_sha256(os.path.join(dir_, n)) for n in names}
    with open(os.path.join(dir_, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)


def load_package(path: str, verified_sha256: str | None = None) -> ModelPackage:
    """Verify and describe the package at `path`; raises PackageError naming the bad file.

    A manifest with `"format": "gguf"` is a GGUF package (`workers.gguf_package.GgufPackage`).
    `verified_sha256`: the daemon verified every file of this package for this load (one verification
    per load); only that the manifest is still the one it verified is checked, not every file again.
    """
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise PackageError(f"{path}: not a model package directory")
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise PackageError(f"{mpath}: cannot read ({e.strerror})") from e
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise PackageError(f"{mpath}: not valid JSON ({e})") from e
    trusted = verified_sha256 is not None
    if trusted and hashlib.sha256(raw).hexdigest() != verified_sha256:
        raise PackageError(f"{mpath}: changed since the daemon verified the package (sha256 differs)")
    if isinstance(manifest, dict) and manifest.get("format") == "gguf":
        from workers.gguf_package import load_gguf_package  # imports this module

        return load_gguf_package(path, manifest, raw, verify_files=not trusted)
    _check_manifest(manifest, mpath)
    files: dict[str, str] = manifest["files"]
    if not trusted:
        verify_listed_files(path, files)

    return ModelPackage(**common_fields(path, manifest, raw), dims=ModelDims.from_dict(manifest["dims"]))


def read_golden(path: str, manifest: dict) -> list[dict]:
    """golden.json, re-hashed against the manifest and checked case by case."""
    gpath = os.path.join(path, GOLDEN)
    try:
        with open(gpath, "rb") as f:
            gdata = f.read()
        if hashlib.sha256(gdata).hexdigest() != manifest["files"][GOLDEN]:
            raise PackageError(f"{gpath}: sha256 does not match the manifest")
        cases = json.loads(gdata)
    except ValueError as e:
        raise PackageError(f"{gpath}: not valid JSON ({e})") from e
    _check_golden(cases, gpath, manifest["vocab_size"], manifest["max_seq"])
    return cases


def common_fields(path: str, manifest: dict, raw: bytes) -> dict:
    """The fields every package kind shares, from a verified manifest (`raw` = its bytes)."""
    return dict(
        path=path,
        manifest=manifest,
        sha256=hashlib.sha256(raw).hexdigest(),
        name=str(manifest.get("name", os.path.basename(path))),
        vocab_size=manifest["vocab_size"],
        eos_ids=tuple(manifest["eos_ids"]),
        bos_id=manifest["bos_id"],
        pad_id=manifest["pad_id"],
        max_seq=manifest["max_seq"],
        block_size=manifest["block_size"],
        profiles=[p["batch"] for p in manifest["profiles"]],
        kv_num_blocks=manifest["kv_num_blocks"],
        golden_cases=read_golden(path, manifest),
    )


# ---- the built-in tiny model -----------------------------------------------------------

def default_model_params_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model.json")


def default_model_params() -> dict:
    with open(default_model_params_path(), "rb") as f:
        return json.load(f)


def cache_root() -> str:
    if os.environ.get("NPUSERVE_CACHE_DIR"):
        return os.environ["NPUSERVE_CACHE_DIR"]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "npuserve")


def default_package_dir() -> str:
    """Where the default tiny package lives: keyed by its parameters and the maker version."""
    with open(default_model_params_path(), "rb") as f:
        key = hashlib.sha256(f.read() + f"\nmaker-v{MAKER_VERSION}".encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "models", f"tiny-{key}")


def ensure_default_package() -> str:
    """Build the default tiny package once and return its path.

    Built in a private temp dir beside the target and renamed into place, so
    a reader never sees a half-written package and two racing builders both
    end up with the one that won the rename.
    """
    def build(out: str) -> None:
        from workers.model_maker import make_model  # the maker imports this module

        make_model(out, **default_model_params())

    return build_package_once(default_package_dir(), build)


def build_package_once(final: str, build) -> str:
    """`build(dir)` a package into a temp dir beside `final` and rename it there, unless one is there already.

    A reader never sees a half-written package, and racing builders all end up
    with the one that won the rename.
    """
    if os.path.isfile(os.path.join(final, MANIFEST)):
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=parent)
    try:
        built = os.path.join(tmp, "pkg")
        build(built)
        try:
            os.rename(built, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, MANIFEST)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
