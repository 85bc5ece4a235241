"""`npuserve keygen [--signing] DIR NAME`: write a CURVE key pair with pyzmq (`zmq.auth.create_certificates`).

`NAME.key` is the public key (give it to the servers' allow-list directory,
or to a client as the server's key); `NAME.key_secret` holds both halves and
stays with its owner. Both files are written 0600 in a directory created
0700; an existing pair is not overwritten.

With `--signing`, an Ed25519 package-signing pair instead (PEM, with the
`cryptography` library): `NAME.ed25519` signs packages (`npuserve
sign-package --key`), `NAME.ed25519.pub` goes to the boards'
`[model] signing_public_key`.
"""

from __future__ import annotations

import argparse
import os
import sys

from ipc.schema import NAME_RE


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="npuserve keygen", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="directory to write into (created 0700)")
    p.add_argument("name", help="key name: for a client key, the tenant it authenticates as")
    p.add_argument("--signing", action="store_true",
                   help="an Ed25519 package-signing pair (NAME.ed25519, NAME.ed25519.pub) instead of a CURVE pair")
    a = p.parse_args(argv)
    if not NAME_RE.match(a.name):
        print(f"npuserve keygen: name {a.name!r}: 1-64 characters of [A-Za-z0-9_.:-]", file=sys.stderr)
        return 2
    if a.signing:
        return _signing_pair(a.dir, a.name)
    import zmq.auth

    os.makedirs(a.dir, mode=0o700, exist_ok=True)
    pub, sec = (os.path.join(a.dir, a.name + ext) for ext in (".key", ".key_secret"))
    if os.path.exists(pub) or os.path.exists(sec):
        print(f"npuserve keygen: {pub} or {sec} exists; remove it first to replace the pair", file=sys.stderr)
        return 1
    old = os.umask(0o077)
    try:
        zmq.auth.create_certificates(a.dir, a.name)
    finally:
        os.umask(old)
    for path in (pub, sec):
        os.chmod(path, 0o600)
    print(f"public key: {pub}\nsecret key: {sec}")
    return 0


def _signing_pair(directory: str, name: str) -> int:
    from engine.daemon.models.package_signature import write_key_pair

    os.makedirs(directory, mode=0o700, exist_ok=True)
    try:
        priv, pub = write_key_pair(directory, name)
    except FileExistsError as e:
        print(f"npuserve keygen: {e.filename} exists; remove it first to replace the pair", file=sys.stderr)
        return 1
    print(f"signing key (private): {priv}\npublic key ([model] signing_public_key): {pub}")
    return 0
