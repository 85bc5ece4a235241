"""Run one harness under libFuzzer in this process (libFuzzer exits the process on a finding).

    python -m tools.fuzz.run_one NAME [--preload MODULE] [libFuzzer flags and corpus dirs...]

`--preload MODULE` imports MODULE after the harness and before fuzzing: the tests use it to put a
deliberately broken decoder in place and check that the harness reports it.
"""

from __future__ import annotations

import importlib
import sys

import atheris

from tools.fuzz import HARNESSES, INSTRUMENT


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in HARNESSES:
        print(f"usage: python -m tools.fuzz.run_one {{{','.join(HARNESSES)}}} [--preload MODULE] "
              f"[libFuzzer args]", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    preload = None
    if rest[:1] == ["--preload"] and len(rest) > 1:
        preload, rest = rest[1], rest[2:]
    # str comparisons feed libFuzzer's dictionary. Not the "RegEx" hook: its pattern proxy takes no `pos`
    # argument, which breaks the standard json module (and would be a false finding).
    atheris.enabled_hooks.add("str")
    with atheris.instrument_imports(include=list(INSTRUMENT)):
        harness = importlib.import_module(f"tools.fuzz.{name}")
    if preload:
        importlib.import_module(preload)
    mutator = getattr(harness, "mutate", None)
    atheris.Setup([f"fuzz-{name}", *rest], harness.one_input, custom_mutator=mutator)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
