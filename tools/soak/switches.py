"""Model switching during a soak: two packages under one alias, `replace` and `rollback` in turn.

The soak's daemon serves alias `soak` from a model root holding package `a`
(the built-in tiny model) and package `b` (the same shape, other weights:
every template's expected tokens differ, so a request answered by the wrong
generation is caught as crosstalk). Switch 1 is `replace soak b`, switch 2
`rollback soak` (back to `a`), and so on.

A request is pinned to the generation it was admitted under, and its `done`
names it. `Generations` keeps which package each generation serves and when
each switch was asked and answered, so that every `done` can be checked: a
request sent while no switch was under way must run on the generation
published then; one sent while a switch was under way on the old or the new
one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass

ALIAS = "soak"
PACKAGES = ("a", "b")


def model_root(parent: str) -> str:
    """`parent/models` with packages `a` (the tiny model) and `b` (its shape, seed 1): built once, copied."""
    from workers.default_package import build_package_once, cache_root, default_model_params, ensure_default_package
    from workers.model_maker import MAKER_VERSION, make_model

    params = {**default_model_params(), "seed": 1, "name": "tiny-b"}
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode() + f"maker-v{MAKER_VERSION}".encode())
    b = build_package_once(os.path.join(cache_root(), "models", f"soak-b-{key.hexdigest()[:16]}"),
                           lambda out: make_model(out, **params))
    root = os.path.join(parent, "models")
    os.makedirs(root, exist_ok=True)
    shutil.copytree(ensure_default_package(), os.path.join(root, "a"))
    shutil.copytree(b, os.path.join(root, "b"))
    return root


@dataclass
class Switch:
    n: int
    op: str  # replace | rollback
    asked: float  # time.monotonic()
    answered: float | None = None
    old_generation: int | None = None
    new_generation: int | None = None
    package: str | None = None
    error: str | None = None

    def row(self, t0: float) -> dict:
        return {"switch": self.n, "op": self.op, "t_s": round(self.asked - t0, 1),
                "seconds": None if self.answered is None else round(self.answered - self.asked, 2),
                "old_generation": self.old_generation, "new_generation": self.new_generation,
                "package": self.package, "error": self.error}


class Generations:
    """Which package each generation serves, and which generation a request sent at a time may run on."""

    def __init__(self, first_generation: int, first_package: str) -> None:
        self.package_of: dict[int, str] = {first_generation: first_package}
        self.first = first_generation
        self.switches: list[Switch] = []

    @property
    def published(self) -> int:
        done = [s for s in self.switches if s.new_generation is not None]
        return done[-1].new_generation if done else self.first

    def next_op(self) -> str:
        return "replace" if len(self.switches) % 2 == 0 else "rollback"

    def allowed(self, sent: float) -> set[int] | None:
        """Generations a request sent at `sent` may run on (None: a failed switch makes it unknowable)."""
        gen = self.first
        for s in self.switches:
            if s.asked > sent:
                break
            if s.answered is None or s.answered >= sent:  # under way when it was sent: old or new
                if s.error is not None or s.new_generation is None:
                    return None  # the new one is not known yet
                return {gen, s.new_generation}
            if s.error is not None:
                return None
            gen = s.new_generation
        return {gen}

    def switch(self, endpoint: str, timeout: float = 600.0) -> Switch:
        """One switch, blocking until the daemon answers (call from a thread)."""
        from engine.client import Client
        from engine.errors import ClientError

        op = self.next_op()
        s = Switch(len(self.switches) + 1, op, time.monotonic(), old_generation=self.published)
        self.switches.append(s)
        fields = {"alias": ALIAS, **({"package": "b"} if op == "replace" else {})}
        try:
            with Client(endpoint, timeout=timeout) as c:
                body = c.call(op, **fields)
            m = body["model"]
            s.new_generation, s.package = int(m["generation"]), m["package"]
            self.package_of[s.new_generation] = s.package
        except (ClientError, KeyError, TypeError, ValueError) as e:
            s.error = f"{type(e).__name__}: {e}"
        s.answered = time.monotonic()
        return s
