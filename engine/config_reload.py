"""What a SIGHUP changes: the difference between two configs, split by what can be applied live.

Pure functions over `Config` values (the daemon's shell reads the file and
applies the result): `config_changes` lists every key whose value differs,
each marked reloadable or not by `engine.config.RELOADABLE`; `reloaded`
builds the config the daemon runs on afterwards: the new values of the
reloadable keys, the old values of everything else (a change that needs a
restart is reported, not half-applied).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Any

from engine.config import RELOADABLE, SECTIONS, Config, TenantConfig
from engine.config_schema import section_keys

_ABSENT = object()


@dataclass(frozen=True)
class Change:
    key: str  # dotted, e.g. "admission.max_sequences" or "queues.tenants.acme.weight"
    old: Any  # None when the key did not exist (a tenant added)
    new: Any  # None when the key no longer exists (a tenant removed)
    reloadable: bool

    def as_dict(self) -> dict:
        return {"key": self.key, "old": _plain(self.old), "new": _plain(self.new)}


def is_reloadable(dotted: str) -> bool:
    return any(fnmatch.fnmatchcase(dotted, pattern) for pattern in RELOADABLE)


def flatten(cfg: Config) -> dict[str, Any]:
    """Every key of `cfg` as a dotted name, tenants included (queues.tenants.NAME.KEY)."""
    out: dict[str, Any] = {}
    for section in SECTIONS:
        value = getattr(cfg, section)
        for name in section_keys(type(value)):
            if section == "queues" and name == "tenants":
                for tenant, tc in value.tenants.items():
                    for tk in section_keys(TenantConfig):
                        out[f"queues.tenants.{tenant}.{tk}"] = getattr(tc, tk)
            else:
                out[f"{section}.{name}"] = getattr(value, name)
    return out


def config_changes(old: Config, new: Config) -> list[Change]:
    """Every key whose value differs, in a stable order (sections as declared, then tenants)."""
    a, b = flatten(old), flatten(new)
    keys = list(a) + [k for k in b if k not in a]
    out = []
    for k in keys:
        va, vb = a.get(k, _ABSENT), b.get(k, _ABSENT)
        if va != vb:
            out.append(Change(k, None if va is _ABSENT else va, None if vb is _ABSENT else vb, is_reloadable(k)))
    return out


def reloaded(old: Config, new: Config) -> Config:
    """`old` with the reloadable keys taken from `new` (the config the daemon runs on after SIGHUP)."""
    replace: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        for name in section_keys(type(getattr(old, section))):
            dotted = f"{section}.{name}"
            if dotted == "queues.tenants":
                dotted = "queues.tenants.*"  # the tenant tables reload as a whole
            if is_reloadable(dotted):
                replace.setdefault(section, {})[name] = getattr(getattr(new, section), name)
    return dataclasses.replace(old, **{s: dataclasses.replace(getattr(old, s), **kv) for s, kv in replace.items()})


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v
