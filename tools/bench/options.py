"""The flags the benchmarks share, defined once: `add(parser, "json", "set", rounds=3)`.

A name alone adds the option with its usual default; `name=value` sets the
default (a `_` in the name stands for `-`); `helps={name: text}` says what
it means for that benchmark where the usual words would not.
"""

from __future__ import annotations

import argparse

THREADS = object()  # default: llama.cpp's thread count for this machine (workers.backends.llamacpp.default_threads)

OPTIONS: dict[str, dict] = {
    "json": {"action": "store_true", "help": "JSON Lines: one object per line, each with its `kind` (row, ..., summary)"},
    "rounds": {"type": int, "help": "paired rounds; each runs every side once, the order flipping every round"},
    "set": {"action": "append", "default": [], "metavar": "KEY=VALUE", "help": "daemon config override (repeatable)"},
    "backend-option": {"action": "append", "default": [], "metavar": "KEY=VALUE",
                       "help": "backend option of the daemon (repeatable)"},
    "package": {"help": "GGUF package (default: Gemma 3 270M, imported on first use)"},
    "threads": {"type": int, "help": "CPU threads of each engine"},
    "clients": {"type": int, "help": "client processes per run"},
    "seed": {"type": int, "help": "seed of the workload"},
    "no-progress": {"action": "store_true", "help": "no live progress bar"},
    "plot": {"metavar": "FILE.png", "help": "draw the plot (needs matplotlib)"},
}


def add(p: argparse.ArgumentParser | argparse._ArgumentGroup, *names: str, helps: dict[str, str] | None = None,
        **defaults) -> None:
    for key in (*names, *defaults):
        name = key.replace("_", "-")
        kw = {k: list(v) if isinstance(v, list) else v for k, v in OPTIONS[name].items()}
        if key in defaults:
            kw["default"] = defaults[key]
        if kw.get("default") is THREADS:
            from workers.backends.llamacpp import default_threads

            kw["default"] = default_threads()
        if helps and key in helps:
            kw["help"] = helps[key]
        p.add_argument("--" + name, **kw)
