"""Backend names -> constructors. Imports lazily, so choosing `stub` never
pulls in the NumPy transformer and a worker only pays for its own backend."""

from __future__ import annotations

import importlib

from workers.backends.base import ChipBackend
from workers.backends.names import BACKENDS

_CLASSES: dict[str, tuple[str, str]] = {
    "stub": ("workers.backends.stub", "StubBackend"),
    "sim": ("workers.backends.sim", "SimBackend"),
    "ref": ("workers.backends.ref", "RefBackend"),
    "ctypes": ("workers.backends.ctypes_backend", "CtypesBackend"),
    "llamacpp": ("workers.backends.llamacpp", "LlamacppBackend"),
}
assert tuple(_CLASSES) == BACKENDS


def backend_class(name: str) -> type[ChipBackend]:
    """The class behind a backend name (imports its module)."""
    if name not in _CLASSES:
        raise ValueError(f"unknown backend {name!r}; valid backends: {', '.join(BACKENDS)}")
    module, cls = _CLASSES[name]
    return getattr(importlib.import_module(module), cls)


def make_backend(name: str, **options) -> ChipBackend:
    """Construct backend `name` with its keyword options (unknown options raise TypeError)."""
    return backend_class(name)(**options)
