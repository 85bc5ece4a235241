"""What every model package kind shares: manifest.json, its checks, and the files it pins.

A package is a folder whose manifest.json pins the sha256 of every other file;
the sha256 of manifest.json itself is the package identity (the model
generation key), so one hash names the exact weights and golden cases. The
`.npz` packages (`workers.model_package`) and the GGUF ones
(`workers.gguf_package`) differ only in their weights file and a few
manifest keys; the rules below hold for both.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

SCHEMA = "npuserve-model/v1"
MANIFEST = "manifest.json"
GOLDEN = "golden.json"
SIGNATURE = "manifest.sig"  # optional detached signature of manifest.json (engine/daemon/models/package_signature.py)


class PackageError(Exception):
    """A package is missing, incomplete, tampered or malformed; the message names the file."""


@dataclass(frozen=True, kw_only=True)
class PackageFacts:
    """What every package kind tells about itself, from its verified manifest (`common_fields`)."""

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
    golden_cases: list[dict] = field(repr=False, default_factory=list)
    # The tensor-parallel degrees (chips per replica) the package can be split into; a kind that
    # cannot be sharded keeps (1,). The `.npz` kind derives them from its dims (manifest `tp_degrees`
    # may narrow them).
    tp_degrees: tuple[int, ...] = (1,)

    def check_tp_degree(self, degree: int) -> None:
        """PackageError unless the package supports running on `degree` chips as one replica."""
        if degree not in self.tp_degrees:
            raise PackageError(f"{self.path}: model {self.name!r} does not support tensor-parallel degree "
                               f"{degree} (board.chips_per_replica); it supports {list(self.tp_degrees)}")

    def file_path(self, name: str) -> str:
        return os.path.join(self.path, name)

    def golden(self) -> list[dict]:
        """[{"prompt": [...], "max_tokens": n, "tokens": [...]}]: greedy, EOS ignored."""
        return [dict(c, prompt=list(c["prompt"]), tokens=list(c["tokens"])) for c in self.golden_cases]


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def need(cond: bool, where: str, msg: str) -> None:
    """Raise PackageError("where: msg") unless `cond`."""
    if not cond:
        raise PackageError(f"{where}: {msg}")


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_manifest(m, where: str, *, ints: tuple[str, ...] = (), min_max_seq: int = 1) -> None:
    """The manifest rules of every package kind: schema, vocabulary and special ids, sizes, profiles, file digests.

    `ints`: the kind's own non-negative integer keys; `min_max_seq`: the shortest context it can serve.
    Each kind checks its architecture, weights file and own keys after this."""
    need(isinstance(m, dict), where, "must be a JSON object")
    need(m.get("schema") == SCHEMA, where, f"unsupported schema {m.get('schema')!r} (expected {SCHEMA!r})")
    for key in ("vocab_size", "bos_id", "pad_id", "max_seq", "block_size", "kv_num_blocks", *ints):
        need(is_int(m.get(key)) and m[key] >= 0, where, f"{key} must be a non-negative integer")
    v = m["vocab_size"]
    need(v > 0 and m["max_seq"] >= min_max_seq and m["block_size"] > 0 and m["kv_num_blocks"] > 0, where,
         "vocab_size, max_seq, block_size and kv_num_blocks must be positive")
    need(m["bos_id"] < v and m["pad_id"] < v, where, "bos_id/pad_id outside the vocabulary")
    eos = m.get("eos_ids")
    need(isinstance(eos, list) and eos and all(is_int(e) and 0 <= e < v for e in eos), where,
         "eos_ids must be a non-empty list of token ids inside the vocabulary")
    profiles = m.get("profiles")
    need(isinstance(profiles, list) and profiles, where, "profiles must be a non-empty list")
    for p in profiles:
        need(isinstance(p, dict) and is_int(p.get("batch")) and p["batch"] > 0, where,
             f"bad profile {p!r}: needs a positive integer batch")
        need(p.get("inactive_lane_policy", "mask") == "mask", where,
             f"profile {p!r}: unsupported inactive_lane_policy")
    batches = [p["batch"] for p in profiles]
    need(len(set(batches)) == len(batches), where, "profiles repeat a batch size")
    files = m.get("files")
    need(isinstance(files, dict), where, "files must map file names to sha256 hex digests")
    for name, digest in files.items():
        need(isinstance(name, str) and name and os.path.basename(name) == name
             and name not in (".", "..", MANIFEST, SIGNATURE), where, f"files lists an invalid file name {name!r}")
        need(isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest),
             where, f"files[{name!r}] is not a sha256 hex digest")


def _check_golden(cases, where: str, vocab: int, max_seq: int) -> None:
    need(isinstance(cases, list), where, "must be a JSON list of cases")
    for i, c in enumerate(cases):
        ok = (
            isinstance(c, dict)
            and isinstance(c.get("prompt"), list) and c["prompt"]
            and isinstance(c.get("tokens"), list)
            and is_int(c.get("max_tokens")) and c["max_tokens"] == len(c["tokens"]) > 0
            and all(is_int(t) and 0 <= t < vocab for t in c["prompt"] + c["tokens"])
            and len(c["prompt"]) + c["max_tokens"] <= max_seq
        )
        need(bool(ok), where, f"case {i} is malformed (prompt, max_tokens == len(tokens), ids in vocab)")


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


@contextlib.contextmanager
def package_folder(out_dir: str, prefix: str) -> Iterator[str]:
    """A temp folder beside `out_dir` for a maker to write a package into; when the block ends it becomes
    `out_dir` (world-readable, one rename: no reader sees a half-written package), or is removed if it fails."""
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_manifest(path: str, what: str) -> tuple[bytes, object]:
    """manifest.json of the package folder `path`: its bytes (their sha256 is the package identity) and its
    JSON, not yet checked; PackageError names the fault (`what`, e.g. "a model package", the folder's kind)."""
    if not os.path.isdir(path):
        raise PackageError(f"{path}: not {what} directory")
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise PackageError(f"{mpath}: cannot read ({e.strerror})") from e
    try:
        return raw, json.loads(raw)
    except ValueError as e:
        raise PackageError(f"{mpath}: not valid JSON ({e})") from e


def read_pinned_npz(fpath: str, sha256: str, since: str) -> dict[str, np.ndarray]:
    """The .npz `fpath`'s arrays as float32, its bytes re-hashed against the manifest's `sha256` as they are
    parsed, so a file swapped since `since` (the check: "verification", "loading") is refused."""
    try:
        with open(fpath, "rb") as f:
            data = f.read()
    except OSError as e:
        raise PackageError(f"{fpath}: cannot read ({e.strerror})") from e
    if hashlib.sha256(data).hexdigest() != sha256:
        raise PackageError(f"{fpath}: sha256 does not match the manifest (file changed after {since})")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {k: np.asarray(z[k], dtype=np.float32) for k in z.files}
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise PackageError(f"{fpath}: not a readable .npz ({e})") from e


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
    """The `PackageFacts` fields, from a verified manifest (`raw` = its bytes)."""
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
