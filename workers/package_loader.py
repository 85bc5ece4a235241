"""`load_package`: read a package's manifest.json and hand it to its kind (`.npz` or GGUF) to verify.

Above both kinds, so neither imports the other: a manifest with
`"format": "gguf"` is a GGUF package (`workers.gguf_package`), any other an
`.npz` one (`workers.model_package`).
"""

from __future__ import annotations

import hashlib
import os

from workers.gguf_package import GgufPackage, is_gguf_manifest, load_gguf_package
from workers.model_package import ModelPackage, load_npz_package
from workers.package_manifest import MANIFEST, PackageError, read_manifest


def load_package(path: str, verified_sha256: str | None = None) -> ModelPackage | GgufPackage:
    """Verify and describe the package at `path`; raises PackageError naming the bad file.

    `verified_sha256`: the daemon verified every file of this package for this load (one verification
    per load); only that the manifest is still the one it verified is checked, not every file again.
    """
    path = os.path.abspath(path)
    raw, manifest = read_manifest(path, "a model package")
    mpath = os.path.join(path, MANIFEST)
    trusted = verified_sha256 is not None
    if trusted and hashlib.sha256(raw).hexdigest() != verified_sha256:
        raise PackageError(f"{mpath}: changed since the daemon verified the package (sha256 differs)")
    load = load_gguf_package if is_gguf_manifest(manifest) else load_npz_package
    return load(path, manifest, raw, verify_files=not trusted)
