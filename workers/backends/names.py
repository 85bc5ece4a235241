"""The chip runtimes a board can run, by name: the one list the config check, the CLI and the registry share.

Apart from the registry so that naming a backend (in a config check) imports no backend code."""

from __future__ import annotations

BACKENDS = ("stub", "sim", "ref", "ctypes", "llamacpp")
