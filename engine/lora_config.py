"""The `[lora]` config section: device and host limits, and the adapters a board loads at start-up.

    [lora]
    max_loaded_per_chip = 8      # adapters in device memory per chip (the backend may hold fewer)
    max_cached = 32              # adapters read into the worker's host memory (LRU)

    [[lora.adapter]]             # one per adapter; `npuserve serve --lora NAME=PATH` adds more
    name = "sql"                 # the model id clients name (`model`, or the wire's `adapter`)
    path = "adapters/sql"        # the adapter package (relative: to the config file's folder)
    base = ""                    # the model alias it adapts; "" = the board's model

The adapters are an array of tables under `[lora]` because TOML cannot hold
both a `[lora]` table of limits and a top-level `[[lora]]` array.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from engine.config_schema import check_section, integer, key, string
from ipc.schema import NAME_RE


@dataclass(frozen=True)
class LoraAdapterConfig:
    name: str = key("", string(NAME_RE, "an adapter name (1-64 characters of [A-Za-z0-9_.:-])"),
                    "the model id clients name the adapter by")
    path: str = key("", string(), "the adapter package folder")
    base: str = key("", string(), "the model alias the adapter adapts; \"\" = the board's model")


def check_adapters(raw: Any, path: str, errors: list[str]) -> tuple[LoraAdapterConfig, ...]:
    if type(raw) is not list:
        errors.append(f"{path}: must be an array of [[lora.adapter]] tables, got {raw!r}")
        return ()
    out: list[LoraAdapterConfig] = []
    for i, table in enumerate(raw):
        where = f"{path}[{i}]"
        got = check_section(LoraAdapterConfig, table, where, errors)
        if "name" not in got or "path" not in got or not got.get("path"):
            errors.append(f"{where}: needs a name and a path")
            continue
        if any(a.name == got["name"] for a in out):
            errors.append(f"{where}.name: adapter {got['name']!r} is listed twice")
            continue
        out.append(LoraAdapterConfig(**got))
    return tuple(out)


@dataclass(frozen=True)
class LoraConfig:
    max_loaded_per_chip: int = key(8, integer(1, 1024), "LoRA adapters held in device memory per chip (LRU swap "
                                                        "beyond it; lanes of at most this many adapters share a job)")
    max_cached: int = key(32, integer(1, 100000), "LoRA adapters kept read in each worker's host memory (LRU)")
    max_adapters: int = key(64, integer(1, 100000), "adapters loaded on the board at once (load-lora beyond it is "
                                                    "refused)")
    adapter: tuple = key((), lambda v: v, "[[lora.adapter]] tables: name, path, base", table=check_adapters)


def with_lora_flags(cfg, flags: list[str]):
    """`cfg` with the `--lora NAME=PATH` adapters after the config file's (paths relative to the working
    directory); ConfigError names a malformed flag or a name listed twice."""
    from engine.config_schema import ConfigError

    if not flags:
        return cfg
    adapters = list(cfg.lora.adapter)
    for text in flags:
        name, sep, path = text.partition("=")
        if not sep or not NAME_RE.match(name) or not path:
            raise ConfigError(f"--lora {text!r}: expected NAME=PATH (NAME: 1-64 characters of [A-Za-z0-9_.:-])")
        if any(a.name == name for a in adapters):
            raise ConfigError(f"--lora {text!r}: adapter {name!r} is listed twice")
        adapters.append(LoraAdapterConfig(name=name, path=os.path.abspath(path)))
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, adapter=tuple(adapters)))
