"""`npuserve sign-package --key PRIVATE --package DIR`: sign a model or LoRA adapter package (writes DIR/manifest.sig).

The package is verified first (every sha256, nothing unlisted), so a
signature never vouches for a package that is already broken, and the new
signature is checked with the key's public half before the command reports
success. Keys come from `npuserve keygen --signing DIR NAME`.
"""

from __future__ import annotations

import argparse
import os
import sys

PROG = "npuserve sign-package"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--key", required=True, help="Ed25519 private key (NAME.ed25519 from `npuserve keygen --signing`)")
    ap.add_argument("--package", required=True, help="model package directory to sign")
    a = ap.parse_args(argv)
    from engine.daemon.models.package_signature import SignatureError, load_private_key, sign_package, \
        verify_manifest_signature
    from workers.lora.adapter_package import LORA_SCHEMA, read_adapter_facts
    from workers.package_loader import load_package
    from workers.package_manifest import MANIFEST, PackageError

    try:
        with open(os.path.join(a.package, MANIFEST), "rb") as f:
            is_adapter = f'"{LORA_SCHEMA}"'.encode() in f.read()
    except OSError:
        is_adapter = False
    try:
        # a LoRA adapter package (docs/lora.md) is verified by its own reader; the signature is the same
        path = read_adapter_facts(a.package).path if is_adapter else load_package(a.package).path
        out = sign_package(a.key, path)
        with open(os.path.join(path, MANIFEST), "rb") as f:
            verify_manifest_signature(load_private_key(a.key).public_key(), path, f.read())
    except PackageError as e:
        print(f"{PROG}: {e}\n(only an intact package can be signed: rebuild or re-import it)", file=sys.stderr)
        return 1
    except SignatureError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"{PROG}: {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    print(out)
    return 0
