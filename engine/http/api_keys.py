"""API keys -> tenants: `Authorization: Bearer KEY` names the fair-queue account of a request.

The key file has one `KEY TENANT` pair per line (whitespace between them);
blank lines and lines starting with `#` are skipped. A tenant is a wire name
(1-64 characters of [A-Za-z0-9_.:-]); several keys may share one tenant.
"""

from __future__ import annotations

from engine.http.openai_error import OpenAIError
from ipc.schema import NAME_RE

MIN_KEY_CHARS = 8


class KeyFileError(ValueError):
    """The key file cannot be used (named line and problem)."""


def parse_key_file(text: str, where: str = "api keys") -> dict[str, str]:
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeyFileError(f"{where}:{n}: expected `KEY TENANT`, got {len(parts)} fields")
        key, tenant = parts
        if len(key) < MIN_KEY_CHARS:
            raise KeyFileError(f"{where}:{n}: a key must be at least {MIN_KEY_CHARS} characters")
        if not NAME_RE.match(tenant):
            raise KeyFileError(f"{where}:{n}: tenant {tenant!r} must be 1-64 characters of [A-Za-z0-9_.:-]")
        if key in keys:
            raise KeyFileError(f"{where}:{n}: the key is listed twice")
        keys[key] = tenant
    if not keys:
        raise KeyFileError(f"{where}: no keys (a front with --api-keys and no key would refuse everyone)")
    return keys


def load_key_file(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as fh:
            return parse_key_file(fh.read(), path)
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read the key file ({e.strerror})") from None


class ApiKeys:
    """`tenant_for(authorization_header)`: the tenant of a known key; 401 otherwise."""

    def __init__(self, keys: dict[str, str]) -> None:
        self._keys = dict(keys)

    def tenant_for(self, authorization: str | None) -> str:
        if not authorization:
            raise OpenAIError(401, "missing API key: send `Authorization: Bearer KEY`", code="invalid_api_key")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise OpenAIError(401, "malformed Authorization header: send `Authorization: Bearer KEY`",
                              code="invalid_api_key")
        tenant = self._keys.get(key)
        if tenant is None:
            raise OpenAIError(401, "incorrect API key provided", code="invalid_api_key")
        return tenant
