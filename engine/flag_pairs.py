"""`KEY=VALUE` command-line pairs (`--set`, `--backend-option`), each value read as TOML.

One parser for every command that takes such flags (the daemon, the benchmarks),
so `--set batch.profiles=[1,4]` means the same everywhere."""

from __future__ import annotations

import tomllib

from engine.config_schema import ConfigError


def parse_value(text: str) -> object:
    """A TOML value ("3", "true", "[1, 4]", "\\"x\\"") or, failing that, the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_pairs(items: list[str], flag: str) -> dict[str, object]:
    """`["a.b=3", "c=x"]` -> `{"a.b": 3, "c": "x"}`; raises ConfigError naming `flag` for an item without `=`."""
    out: dict[str, object] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE")
        out[k.strip()] = parse_value(v.strip())
    return out
