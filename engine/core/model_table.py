"""Which models a board serves: aliases, their generations, routing, capacity, drains and rollback history.

Pure bookkeeping driven with `now` (no clock, no I/O), so the rules are
testable with a fake clock: the daemon's shell owns the processes of each
generation and asks this table what to do.

* An alias points at exactly one published (Ready) generation, or at none.
  A request's `model` (the default alias when absent) routes to it: 404 for
  an alias the board does not know, 503 (retryable) while that alias has no
  Ready generation (loading, draining for an unload). Once routed, a request
  stays pinned to its generation.
* Publishing flips the alias to a new generation in one assignment, after
  its golden cases and warm-up passed (so a package that loads but answers
  wrong never serves a request); the generation it replaces starts draining.
* Capacity: each generation needs `need.memory_bytes` of the board's budget
  (its workers' weights and KV pools); a load whose need does not fit beside
  the generations holding resources is refused with the numbers.
* Drains end when the generation has no request and no job left, or at the
  deadline: with jobs still on a chip the generation goes to Recovering.
* Rollback history: the packages an alias published, newest last.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from engine.core.model_state import HOLDS_RESOURCES, RUNS_REQUESTS, TERMINAL, ModelState, check_transition

M = ModelState
MIB = 1 << 20


@dataclass(frozen=True)
class Need:
    """What one generation holds on the board: over all its chips."""

    chips: int
    weights_bytes: int  # per chip (each worker holds the whole model)
    kv_blocks: int  # per chip
    kv_block_bytes: int

    @property
    def memory_bytes(self) -> int:
        return self.chips * (self.weights_bytes + self.kv_blocks * self.kv_block_bytes)

    def describe(self) -> str:
        return (f"{_mib(self.memory_bytes)} = {self.chips} chip(s) x (weights {_mib(self.weights_bytes)} + "
                f"{self.kv_blocks} KV blocks x {self.kv_block_bytes} B)")


@dataclass
class GenerationRecord:
    id: int
    alias: str
    package: str  # as the operator named it
    kind: str  # "load" | "replace" | "rollback" | "startup"
    state: ModelState = M.VALIDATING
    path: str = ""  # resolved under the model root
    sha256: str = ""
    need: Need | None = None
    created_at: float = 0.0
    ready_at: float | None = None
    drain_deadline: float | None = None
    drain_started_at: float | None = None
    step: str = "resolve"  # the load step running (or the one that failed)
    error: str | None = None
    active_requests: int = 0
    counters: Counter = field(default_factory=Counter)

    @property
    def default_counters(self) -> dict[str, int]:
        return {k: int(self.counters.get(k, 0)) for k in ("requests", "completed", "failed", "rejected")}


class RouteOutcome(enum.Enum):
    OK = "ok"
    UNKNOWN = "unknown"  # 404
    UNAVAILABLE = "unavailable"  # 503, retryable


@dataclass(frozen=True)
class Route:
    outcome: RouteOutcome
    generation: GenerationRecord | None = None
    message: str = ""


class DrainVerdict(enum.Enum):
    WAIT = "wait"
    DONE = "done"  # nothing left: unload now
    DEADLINE = "deadline"  # requests left at the deadline: cancel them
    RECOVER = "recover"  # jobs still on a chip at the deadline: keep the buffers (Recovering)


class LifecycleError(Exception):
    """An admin op that cannot start: `code` (HTTP-like) and `reason` for the error event."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


class ModelTable:
    def __init__(self, default_alias: str, budget_bytes: int = 0) -> None:
        """`budget_bytes` 0: no memory budget (loads are refused only by what fails to start)."""
        self.default_alias = default_alias
        self.budget_bytes = budget_bytes
        self.generations: dict[int, GenerationRecord] = {}
        self.published: dict[str, int] = {}  # alias -> its Ready generation
        self.busy: dict[str, int] = {}  # alias -> the generation of the admin op running on it
        self.history: dict[str, list[tuple[str, str]]] = {}  # alias -> [(package, resolved path)], newest last
        self._ids = 0

    # -- generations --------------------------------------------------------------------
    def begin(self, alias: str, package: str, kind: str, now: float) -> GenerationRecord:
        """A new generation for a load/replace/rollback of `alias`; LifecycleError when the op may not start."""
        if alias in self.busy:
            other = self.generations[self.busy[alias]]
            raise LifecycleError(409, "busy", f"{alias!r}: a {other.kind} (generation {other.id}, "
                                              f"{other.state.value}) is still running; retry when it ends")
        if kind in ("load", "startup") and alias in self.published:
            raise LifecycleError(409, "already_loaded", f"{alias!r} is already loaded (generation "
                                                        f"{self.published[alias]}); use replace to change it")
        if kind in ("replace", "rollback") and alias not in self.published:
            raise LifecycleError(404, "model_not_found", f"{alias!r} is not loaded here; use load")
        for old in [g for g in self.generations.values() if g.alias == alias and g.state is M.FAILED]:
            del self.generations[old.id]  # the last failure of an alias is listed until its next op
        self._ids += 1
        rec = GenerationRecord(self._ids, alias, package, kind, created_at=now)
        self.generations[rec.id] = rec
        self.busy[alias] = rec.id
        return rec

    def rollback_package(self, alias: str) -> tuple[str, str]:
        """(package, resolved path) `alias` published before its current one; LifecycleError when none."""
        hist = self.history.get(alias, [])
        if alias not in self.published:
            raise LifecycleError(404, "model_not_found", f"{alias!r} is not loaded here")
        if len(hist) < 2:
            raise LifecycleError(409, "no_previous", f"{alias!r} has no previous package to roll back to")
        return hist[-2]

    def transition(self, rec: GenerationRecord, new: ModelState) -> None:
        rec.state = check_transition(rec.state, new)
        if new in TERMINAL or new is M.READY:
            if self.busy.get(rec.alias) == rec.id:
                del self.busy[rec.alias]

    def fail(self, rec: GenerationRecord, step: str, message: str) -> None:
        rec.step, rec.error = step, message
        self.transition(rec, M.FAILED)

    def publish(self, rec: GenerationRecord, now: float) -> GenerationRecord | None:
        """Point rec.alias at rec (Warming -> Ready); returns the generation it replaces (still Ready)."""
        prev_id = self.published.get(rec.alias)
        self.transition(rec, M.READY)
        rec.ready_at = now
        self.published[rec.alias] = rec.id
        hist = self.history.setdefault(rec.alias, [])
        if rec.kind == "rollback" and len(hist) >= 2:
            hist.pop()  # the package rolled back from; the previous one is current again
        else:
            hist.append((rec.package, rec.path))
        return None if prev_id is None else self.generations[prev_id]

    def begin_drain(self, rec: GenerationRecord, now: float, deadline_s: float) -> None:
        """Ready -> Draining; an unload (rec still published) takes the alias away at once."""
        self.transition(rec, M.DRAINING)
        rec.drain_started_at = now
        rec.drain_deadline = now + max(0.0, deadline_s)
        if self.published.get(rec.alias) == rec.id:
            del self.published[rec.alias]

    def drain_verdict(self, rec: GenerationRecord, now: float, active: int, inflight_jobs: int) -> DrainVerdict:
        assert rec.state is M.DRAINING and rec.drain_deadline is not None
        if active == 0 and inflight_jobs == 0:
            return DrainVerdict.DONE
        if now < rec.drain_deadline:
            return DrainVerdict.WAIT
        return DrainVerdict.RECOVER if inflight_jobs else DrainVerdict.DEADLINE

    def forget(self, rec: GenerationRecord) -> None:
        """Drop a terminal generation from the table (its entry has been reported)."""
        assert rec.state in TERMINAL
        self.generations.pop(rec.id, None)

    # -- requests ------------------------------------------------------------------------
    def route(self, model: str | None) -> Route:
        alias = self.default_alias if model is None else model
        gid = self.published.get(alias)
        if gid is not None:
            return Route(RouteOutcome.OK, self.generations[gid])
        draining = [g for g in self.generations.values() if g.alias == alias and g.state not in TERMINAL]
        if draining or alias in self.busy:
            states = ", ".join(sorted({g.state.value for g in draining})) or "loading"
            return Route(RouteOutcome.UNAVAILABLE, None, f"model {alias!r} is not ready ({states}); retry")
        known = sorted(self.published)
        if model is None:
            return Route(RouteOutcome.UNAVAILABLE, None, f"no default model is loaded ({alias!r}); name one of "
                                                         f"{known} in `model`" if known else
                         f"no model is loaded on this board (default {alias!r})")
        return Route(RouteOutcome.UNKNOWN, None, f"model {alias!r} is not served here (this board serves "
                                                 f"{', '.join(map(repr, known)) or 'no model'})")

    # -- capacity ----------------------------------------------------------------------------
    def holding(self, excluding: tuple[int, ...] = ()) -> list[GenerationRecord]:
        return [g for g in self.generations.values()
                if g.state in HOLDS_RESOURCES and g.need is not None and g.id not in excluding]

    def refuse_capacity(self, rec: GenerationRecord, need: Need, excluding: tuple[int, ...] = ()) -> str | None:
        """None when `need` fits the budget beside what the other generations hold; else why not, in numbers."""
        if not self.budget_bytes:
            return None
        others = [g for g in self.holding(excluding) if g.id != rec.id]
        held = sum(g.need.memory_bytes for g in others)
        if held + need.memory_bytes <= self.budget_bytes:
            return None
        who = ", ".join(f"{g.alias} gen {g.id} {_mib(g.need.memory_bytes)}" for g in others) or "nothing"
        return (f"{rec.alias!r} needs {need.describe()}; the board's budget is {_mib(self.budget_bytes)} "
                f"(board.memory_budget_mb) and {_mib(held)} is held ({who}), so "
                f"{_mib(max(0, self.budget_bytes - held))} is free")

    # -- time ----------------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        ds = [g.drain_deadline for g in self.generations.values() if g.state is M.DRAINING]
        return min(ds) if ds else None

    def serving(self) -> list[GenerationRecord]:
        """Generations that run requests now (their schedulers are ticked)."""
        return [g for g in self.generations.values() if g.state in RUNS_REQUESTS]


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"
