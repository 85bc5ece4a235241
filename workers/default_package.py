"""The built-in tiny model, built on first use into the user's cache: as `.npz` (`ref`) and as GGUF (`llamacpp`).

Above both makers (`workers.model_maker`, `workers.tiny_gguf_package`). A
package's folder is keyed by the parameters (default_model.json) and the
maker's version, so a cache built by older code is never reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable

from workers.model_maker import MAKER_VERSION, make_model
from workers.package_manifest import MANIFEST
from workers.tiny_gguf_package import GGUF_MAKER_VERSION, make_gguf_model


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


def default_gguf_package_dir() -> str:
    base = os.path.basename(default_package_dir())
    return os.path.join(cache_root(), "models", f"{base}-gguf-v{GGUF_MAKER_VERSION}")


def ensure_default_package() -> str:
    """Build the default tiny package once and return its path."""
    return build_package_once(default_package_dir(), lambda out: make_model(out, **default_model_params()))


def ensure_default_gguf_package() -> str:
    """Build the tiny model's GGUF package once (race-safe, as the `.npz` one) and return its path."""
    return build_package_once(default_gguf_package_dir(), lambda out: make_gguf_model(out, **default_model_params()))


def build_package_once(final: str, build: Callable[[str], object]) -> str:
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
