"""The machinery of strictly checked TOML config files, shared by the daemon's, the balancer's and the HTTP front's.

Each key is a dataclass field declared with `key(default, check, doc)`; a
check takes the raw TOML value and returns the converted one or raises
`BadValue`, which `check_section` prefixes with the key's dotted path. A
bool is never accepted as a number, and unknown keys are errors with a
"did you mean". Pure (no I/O), so the sans-I/O core can raise `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable
from dataclasses import field
from typing import Any

from ipc.schema import NAME_RE

UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the NUL


class ConfigError(ValueError):
    """Invalid configuration, or one the model or chips cannot serve (fail fast at start-up).

    `errors` holds one "key: problem" line per problem found."""

    def __init__(self, errors: list[str] | str) -> None:
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


class BadValue(Exception):
    """A check's complaint about one value; the loader prefixes the key."""


Check = Callable[[Any], Any]
# A key whose value is a table of tables (e.g. [queues.tenants.NAME]): (raw, dotted path, errors) -> value.
TableCheck = Callable[[Any, str, list[str]], Any]


def key(default: Any, check: Check, doc: str, *, table: TableCheck | None = None) -> Any:
    """Declare one config key: its default, its check and its one-line meaning.

    `table`: the key holds a table of tables, checked as a whole by `table(raw, path, errors)`
    (so each problem inside it gets its own error line) instead of by `check`."""
    metadata = {"check": check, "doc": doc, **({"table": table} if table else {})}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def section_keys(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def unknown(path: str, name: str, known: list[str], what: str = "key") -> str:
    """The error line for an unknown key or section, with the closest known name."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
    return f"{path}: unknown {what}{hint}"


def check_section(cls: type, raw: Any, path: str, errors: list[str]) -> dict[str, Any]:
    """Check one table; return its converted values (only the keys present and valid)."""
    if type(raw) is not dict:
        errors.append(f"{path}: must be a table, got {raw!r}")
        return {}
    fields = section_keys(cls)
    out: dict[str, Any] = {}
    for name, value in raw.items():
        f = fields.get(name)
        if f is None:
            errors.append(unknown(f"{path}.{name}", name, list(fields)))
        elif "table" in f.metadata:
            out[name] = f.metadata["table"](value, f"{path}.{name}", errors)
        else:
            try:
                out[name] = f.metadata["check"](value)
            except BadValue as bad:
                errors.append(f"{path}.{name}: {bad}")
    return out


# ---------------------------------------------------------------- checks


def integer(lo: int, hi: int | None = None) -> Check:
    def check(v: Any) -> int:
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        if type(v) is not int or v < lo or (hi is not None and v > hi):
            raise BadValue(f"must be an int {rng}, got {v!r}")
        return v
    return check


def number(lo: float, hi: float | None = None, lo_open: bool = False) -> Check:
    def check(v: Any) -> float:
        op = ">" if lo_open else ">="
        rng = f"{op} {lo}" + ("" if hi is None else f" and <= {hi}")
        if type(v) not in (int, float) or not math.isfinite(v) or (v <= lo if lo_open else v < lo) \
                or (hi is not None and v > hi):
            raise BadValue(f"must be a finite number {rng}, got {v!r}")
        return float(v)
    return check


def boolean(v: Any) -> bool:
    if type(v) is not bool:
        raise BadValue(f"must be true or false, got {v!r}")
    return v


def string(pattern: re.Pattern | None = None, what: str = "a string", choices: tuple[str, ...] = ()) -> Check:
    def check(v: Any) -> str:
        if type(v) is not str:
            raise BadValue(f"must be {what}, got {v!r}")
        if choices and v not in choices:
            raise BadValue(f"must be one of {', '.join(choices)}, got {v!r}")
        if pattern is not None and not pattern.match(v):
            raise BadValue(f"must be {what}, got {v!r}")
        return v
    return check


def name_list(what: str) -> Check:
    """A list of names (key names, tenants): each 1-64 characters of [A-Za-z0-9_.:-], the wire's rule."""
    def check(v: Any) -> tuple[str, ...]:
        if type(v) not in (list, tuple) or not all(type(x) is str and NAME_RE.match(x) for x in v):
            raise BadValue(f"must be a list of {what} (1-64 characters of [A-Za-z0-9_.:-]), got {v!r}")
        return tuple(v)
    return check


def abs_path_or_empty(v: Any) -> str:
    if type(v) is not str or (v and not os.path.isabs(v)):
        raise BadValue(f"must be an absolute path or \"\", got {v!r}")
    return v


def abs_paths(v: Any) -> tuple[str, ...]:
    if type(v) not in (list, tuple) or not all(type(x) is str and os.path.isabs(x) for x in v):
        raise BadValue(f"must be a list of absolute paths, got {v!r}")
    return tuple(v)


def zmq_endpoint(v: Any) -> str:
    """A ZeroMQ endpoint: ipc:///absolute/path (within the unix socket path limit) or tcp://HOST:PORT."""
    if type(v) is not str:
        raise BadValue(f"must be a string, got {v!r}")
    if v.startswith("ipc://"):
        path = v[len("ipc://"):]
        if not path.startswith("/"):
            raise BadValue(f"ipc:// endpoints need an absolute path, got {v!r}")
        if len(path.encode()) > UNIX_PATH_MAX:
            raise BadValue(f"ipc path longer than {UNIX_PATH_MAX} bytes (a unix socket limit): {v!r}")
        return v
    if re.fullmatch(r"tcp://(\*|[A-Za-z0-9_.:\[\]-]+):(\d{1,5})", v):
        port = int(v.rsplit(":", 1)[1])
        if 1 <= port <= 65535:
            return v
    raise BadValue(f"must be ipc:///absolute/path or tcp://HOST:PORT, got {v!r}")


def zmq_endpoint_or_empty(v: Any) -> str:
    return v if v == "" else zmq_endpoint(v)


def zmq_endpoints(v: Any) -> tuple[str, ...]:
    if type(v) not in (list, tuple):
        raise BadValue(f"must be a list of endpoint strings, got {v!r}")
    out = []
    for i, e in enumerate(v):
        try:
            out.append(zmq_endpoint(e))
        except BadValue as bad:
            raise BadValue(f"[{i}] {bad}") from None
    if len(set(out)) != len(out):
        raise BadValue("must not repeat an endpoint")
    return tuple(out)


def host_port(v: Any) -> str:
    """An address to listen on: HOST:PORT, HOST a name, an IPv4 address or a bracketed IPv6 one."""
    if type(v) is not str or not re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", v) \
            or not 0 <= int(v.rsplit(":", 1)[1]) <= 65535:
        raise BadValue(f"must be HOST:PORT (e.g. \"127.0.0.1:8000\"), got {v!r}")
    return v
