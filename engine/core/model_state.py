"""The lifecycle state of one model generation, with its allowed transitions (docs/models.md, "States").

A generation is one load of one package under one alias. It is born
Validating (resolve, verify, validate, capacity), is Configuring while its
workers start, Warming while its golden cases and warm-up run as real
requests, and Ready once published (the alias points at it). Unload and
replace move it to Draining (no new requests; those in flight finish until a
deadline), then Unloading (workers stopped, shared memory freed) and
Unloaded. A drain whose deadline passes with jobs still on a chip goes to
Recovering instead: its buffers stay allocated until no job can write them
(a forced unload does not stop a job already on the chip, which would write
freed memory). Failed is the end of a load
that did not pass a step; its resources are released like an unload's.
"""

from __future__ import annotations

import enum


class ModelState(enum.Enum):
    UNLOADED = "unloaded"
    VALIDATING = "validating"
    CONFIGURING = "configuring"
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    UNLOADING = "unloading"
    RECOVERING = "recovering"
    FAILED = "failed"


M = ModelState
ALLOWED: dict[ModelState, frozenset[ModelState]] = {
    M.VALIDATING: frozenset({M.CONFIGURING, M.FAILED}),
    M.CONFIGURING: frozenset({M.WARMING, M.FAILED}),
    M.WARMING: frozenset({M.READY, M.FAILED}),
    M.READY: frozenset({M.DRAINING}),
    M.DRAINING: frozenset({M.UNLOADING, M.RECOVERING}),
    M.RECOVERING: frozenset({M.UNLOADING}),
    M.UNLOADING: frozenset({M.UNLOADED}),
    M.FAILED: frozenset(),
    M.UNLOADED: frozenset(),
}
# States whose workers exist (or may still exist) and count against the board's capacity.
HOLDS_RESOURCES = frozenset({M.CONFIGURING, M.WARMING, M.READY, M.DRAINING, M.UNLOADING, M.RECOVERING})
# States a generation may run requests in (golden cases run while Warming).
RUNS_REQUESTS = frozenset({M.WARMING, M.READY, M.DRAINING})
TERMINAL = frozenset({M.UNLOADED, M.FAILED})


def check_transition(old: ModelState, new: ModelState) -> ModelState:
    """`new` if the lifecycle allows old -> new; an AssertionError (a bug) otherwise."""
    assert new in ALLOWED[old], f"model generation cannot go {old.value} -> {new.value}"
    return new
