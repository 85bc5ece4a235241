"""The board's default alias when the operator names a package but no `model.alias`: the package's own name.

A board started with `--package DIR` answers as the model the package says it
is (its manifest's `name`, else the folder's name), not as `tiny`. The name is
made a valid alias (`ipc.schema.NAME_RE`: characters outside [A-Za-z0-9_.:-]
become `-`, a leading `.`/`:`/`-` and a trailing `-` go, at most 64 characters);
when nothing usable is left the alias is `DEFAULT_ALIAS`, the built-in model's.
Reading the manifest is best effort: a missing or broken package is reported
by the load itself, with its own message, not here.
"""

from __future__ import annotations

import json
import os
import re

from ipc.schema import NAME_RE

DEFAULT_ALIAS = "tiny"  # the built-in model's alias, and the fallback when a package's name has nothing usable
MANIFEST = "manifest.json"  # as workers.package_manifest.MANIFEST
MAX_MANIFEST_BYTES = 1 << 20

_INVALID = re.compile(r"[^A-Za-z0-9_.:-]+")


def as_alias(name: str) -> str | None:
    """`name` made a valid alias, or None when nothing usable is left."""
    alias = _INVALID.sub("-", name).lstrip(".:-")[:64].rstrip("-")
    return alias if NAME_RE.match(alias) else None


def manifest_name(package: str) -> str | None:
    """The `name` in the package's manifest.json; None when there is none (or it cannot be read)."""
    try:
        with open(os.path.join(package, MANIFEST), "rb") as fh:
            manifest = json.loads(fh.read(MAX_MANIFEST_BYTES))
    except (OSError, ValueError):
        return None
    name = manifest.get("name") if isinstance(manifest, dict) else None
    return name if isinstance(name, str) else None


def alias_from_package(package: str) -> str:
    """The default alias of a board serving `package` (a folder path)."""
    folder = os.path.basename(os.path.normpath(os.path.abspath(package)))
    for name in (manifest_name(package), folder):
        alias = as_alias(name) if name else None
        if alias:
            return alias
    return DEFAULT_ALIAS
