"""Detached Ed25519 signatures of model packages (`manifest.sig`), with the `cryptography` library.

The signature covers the exact bytes of `manifest.json`, which pins the
sha256 of every other file of the package, so one signature vouches for the
whole package once the hashes are verified. The signature sits beside the
manifest as `manifest.sig`, a small JSON object:

    {"schema": "npuserve-signature/v1", "algorithm": "ed25519",
     "key_sha256": "<sha256 of the raw 32-byte public key>", "signature": "<base64>"}

`key_sha256` only serves the error message ("signed by another key"); the
check itself is the Ed25519 verification with the configured public key.
Keys are PEM files written by `npuserve keygen --signing DIR NAME`:
`NAME.ed25519` (private, PKCS#8, 0600) and `NAME.ed25519.pub` (public).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from workers.package_manifest import MANIFEST, SIGNATURE

SIGNATURE_SCHEMA = "npuserve-signature/v1"
ALGORITHM = "ed25519"
PRIVATE_SUFFIX = ".ed25519"
PUBLIC_SUFFIX = ".ed25519.pub"


class SignatureError(Exception):
    """A key or signature cannot be read, or the signature does not verify; the message names the file."""


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_fingerprint(key: Ed25519PublicKey) -> str:
    """sha256 hex of the raw public key: how messages and `manifest.sig` name a key."""
    return hashlib.sha256(_raw_public(key)).hexdigest()


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SignatureError(f"{path}: cannot read the {what} ({e.strerror})") from None


def load_public_key(path: str) -> Ed25519PublicKey:
    data = _read(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as e:
        raise SignatureError(f"{path}: not a PEM public key ({e}); make one with `npuserve keygen --signing`") \
            from None
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"{path}: not an Ed25519 public key ({type(key).__name__})")
    return key


def load_private_key(path: str) -> Ed25519PrivateKey:
    data = _read(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise SignatureError(f"{path}: not an unencrypted PEM private key ({e}); "
                             f"make one with `npuserve keygen --signing`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"{path}: not an Ed25519 private key ({type(key).__name__})")
    return key


def write_key_pair(directory: str, name: str) -> tuple[str, str]:
    """Write NAME.ed25519 (private) and NAME.ed25519.pub (public), 0600, refusing to overwrite; returns both paths."""
    priv_path = os.path.join(directory, name + PRIVATE_SUFFIX)
    pub_path = os.path.join(directory, name + PUBLIC_SUFFIX)
    key = Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    written = []
    try:
        for path, data in ((priv_path, priv), (pub_path, pub)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            written.append(path)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
    except BaseException:
        for path in written:
            os.unlink(path)
        raise
    return priv_path, pub_path


def sign_package(private_key_path: str, package_dir: str) -> str:
    """Sign `package_dir/manifest.json` and write `manifest.sig` (replacing an old one); returns its path."""
    key = load_private_key(private_key_path)
    manifest = _read(os.path.join(package_dir, MANIFEST), "manifest")
    doc = {"schema": SIGNATURE_SCHEMA, "algorithm": ALGORITHM, "key_sha256": key_fingerprint(key.public_key()),
           "signature": base64.b64encode(key.sign(manifest)).decode()}
    out = os.path.join(package_dir, SIGNATURE)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, out)  # a reader sees the old signature or the new one, never half of one
    return out


def read_signed_manifest(public_key_path: str, package_dir: str) -> bytes:
    """`package_dir`'s manifest.json bytes, their signature verified with the PEM public key at
    `public_key_path`: SignatureError when the key or signature is bad, OSError when the manifest cannot be
    read. The caller checks that what it then loads was built from these very bytes."""
    key = load_public_key(public_key_path)
    with open(os.path.join(package_dir, MANIFEST), "rb") as f:
        signed = f.read()
    verify_manifest_signature(key, package_dir, signed)
    return signed


def verify_manifest_signature(public_key: Ed25519PublicKey, package_dir: str, manifest: bytes) -> None:
    """Raise SignatureError unless `package_dir/manifest.sig` is `public_key`'s signature of `manifest`."""
    spath = os.path.join(package_dir, SIGNATURE)
    if not os.path.lexists(spath):
        raise SignatureError(f"{spath}: missing; a signing key is configured, so the package must be signed "
                             f"(npuserve sign-package --key PRIVATE --package {package_dir})")
    try:
        doc = json.loads(_read(spath, "signature"))
    except ValueError as e:
        raise SignatureError(f"{spath}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SIGNATURE_SCHEMA:
        raise SignatureError(f"{spath}: not a {SIGNATURE_SCHEMA} signature object")
    if doc.get("algorithm") != ALGORITHM:
        raise SignatureError(f"{spath}: unsupported algorithm {doc.get('algorithm')!r} (expected {ALGORITHM!r})")
    try:
        sig = base64.b64decode(str(doc.get("signature", "")), validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError(f"{spath}: signature is not base64") from None
    expected = key_fingerprint(public_key)
    if doc.get("key_sha256") != expected:
        raise SignatureError(f"{spath}: signed by key {str(doc.get('key_sha256'))[:16]}..., "
                             f"not by the configured key {expected[:16]}...")
    try:
        public_key.verify(sig, manifest)
    except InvalidSignature:
        raise SignatureError(f"{spath}: the signature does not verify against manifest.json "
                             f"(the manifest changed after signing, or the signature is forged)") from None
