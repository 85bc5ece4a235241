"""One load (or replace, rollback, start-up load) of an alias, carried out step by step on the loop.

Steps (docs/models.md#the-package-gate): resolve, verify (every sha256; in a thread, since
hashing a large package takes seconds and the loop must keep serving),
validate (manifest against the config), capacity (the board's budget),
configure (start the generation's workers; their READY arrives on the
loop's poller), golden (the package's golden cases run as real greedy
requests on the new generation), warmup (one short request per chip), then
publish: the alias flips to the new generation in one assignment. A failure
at any step stops the new generation's workers, frees its shared memory and
leaves the serving generation untouched; the error names the step.

The job is polled by the loop (`poll(now)`) and fed the events of its own
requests (`on_event`); it never blocks.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Protocol

from engine.config import Config
from engine.core import golden_check
from engine.core.actions import EmitTokens, FailRequest, FinishRequest
from engine.core.model_state import TERMINAL, ModelState
from engine.core.model_table import GenerationRecord, ModelTable, Need
from engine.core.requests import GenerateParams
from engine.daemon.log import log
from engine.daemon.lora_registry import LoraRegistry, misfits
from engine.daemon.models import package_gate
from engine.daemon.models.package_gate import PackageRefused
from engine.daemon.models.generation import Generation, GenerationError

M = ModelState
STARTUP_TIMEOUT_S = 120.0  # READY of every worker of a new generation (the ref model may be built on first run)
CHECK_TIMEOUT_S = 120.0  # golden cases and warm-up together
WARMUP_TOKENS = 2  # a prefill and one decode step per chip


class LoadFailed(Exception):
    def __init__(self, step: str, message: str, code: int = 500, reason: str = "load_failed") -> None:
        super().__init__(message)
        self.step, self.message, self.code, self.reason = step, message, code, reason


# The error code and reason of a failed step (the message names the cause).
STEP_ERRORS = {"resolve": (400, "package_rejected"), "verify": (400, "package_rejected"),
               "signature": (400, "package_rejected"), "validate": (400, "package_rejected"),
               "capacity": (429, "insufficient_capacity"), "configure": (500, "load_failed"),
               "golden": (500, "golden_mismatch"), "warmup": (500, "load_failed")}


class LoadHost(Protocol):
    """What a load job drives: the generations registry (engine/daemon/generations.py)."""

    cfg: Config
    models: ModelTable
    lora: LoraRegistry

    def new_generation(self, rec: GenerationRecord, *, package_path: str | None, package) -> Generation: ...

    def publish(self, g: Generation, now: float) -> GenerationRecord | None: ...

    def drop_generation(self, g: Generation) -> None: ...

    def begin_unload(self, rec: GenerationRecord, *, now: float, deadline_s: float) -> None: ...

    def next_request_id(self) -> int: ...

    def open_internal(self, rid: int, g: Generation, job: "LoadJob") -> None: ...

    def close_internal(self, rid: int) -> None: ...

    def apply(self, actions: list, g: Generation, now: float) -> None: ...

    def run_in_thread(self, fn) -> concurrent.futures.Future: ...

    def wake(self) -> None: ...


class LoadJob:
    def __init__(self, d: LoadHost, rec: GenerationRecord, *,
                 done: Callable[["LoadJob"], None], package_path: str | None = None, resolve: bool = True,
                 drain_s: float = 30.0) -> None:
        """`resolve`: look rec.package up under the model root; else `package_path` is the package (None: the
        backend needs none: stub, sim, ctypes)."""
        self.d = d
        self.rec = rec
        self.done = done  # called once, with the job finished (self.error None on success)
        self.error: LoadFailed | None = None
        self.generation: Generation | None = None
        self.previous: GenerationRecord | None = None  # the generation a replace/rollback took the alias from
        self.drained: GenerationRecord | None = None  # ... or the one it drained first (no room for both)
        self.drain_s = drain_s
        self._package_path = package_path
        self._resolve = resolve
        self._request_error: LoadFailed | None = None
        self._future: concurrent.futures.Future | None = None
        self._pkg = None
        self._misfits: dict[str, str] = {}  # loaded LoRA adapters of the alias that the package does not fit
        self._facts: package_gate.CapacityFacts | None = None
        self._started = 0.0
        self._pending: dict[int, int] = {}  # request id -> golden case index (-1: warm-up)
        self._outputs: dict[int, list[int]] = {}
        self._finish: dict[int, str] = {}  # golden case -> finish reason
        self._errors: dict[int, str] = {}  # golden case -> the error that ended it
        self._cases: list[dict] = []
        self._phase = "verify"
        self._queue: list[int] = []  # golden cases not sent yet
        self.finished = False

    # -- driving ---------------------------------------------------------------------------
    def start(self, now: float) -> None:
        cfg = self.d.cfg
        package, given, resolve = self.rec.package, self._package_path, self._resolve
        # A new generation of an alias must fit the LoRA adapters loaded on it (none can be added meanwhile:
        # the alias is busy); the adapter gate's check, off the loop
        adapters = self.d.lora.of_base(self.rec.alias) if self.rec.kind in ("replace", "rollback") else []

        def check():  # in a thread: the package gate's file work, no loop state touched
            path = package_gate.resolve_package(cfg.model.root, package) if resolve else given
            if path is None:
                return None, None, None
            pkg = package_gate.verify_package(path, cfg.model.signing_public_key)
            package_gate.validate_package(pkg, cfg)
            if adapters:
                self._misfits = misfits(adapters, pkg, self.rec.alias)
            return path, pkg, package_gate.capacity_facts(pkg, cfg)

        self._started = now
        self.rec.step = "resolve"
        self._future = self.d.run_in_thread(check)

    def poll(self, now: float) -> None:
        """Advance as far as possible without blocking."""
        if self.finished:
            return
        try:
            self._advance(now)
        except (PackageRefused, GenerationError) as e:
            self._fail(LoadFailed(e.step, e.message, *STEP_ERRORS.get(e.step, (500, "load_failed"))), now)
        except LoadFailed as e:
            self._fail(e, now)

    def _advance(self, now: float) -> None:
        rec, d = self.rec, self.d
        if self._phase == "verify":
            if not self._future.done():
                return
            path, pkg, f = self._future.result()  # PackageRefused (naming its step) propagates
            self._future = None
            unfit = {n: why for n, why in self._misfits.items() if n in d.lora.by_name}  # not unloaded meanwhile
            if unfit:
                raise LoadFailed("validate", f"the LoRA adapters {', '.join(sorted(unfit))} loaded on "
                                             f"{rec.alias!r} do not fit this package (unload them first): "
                                             + "; ".join(f"{n}: {unfit[n]}" for n in sorted(unfit)),
                                 *STEP_ERRORS["validate"])
            rec.path = path or ""
            self._pkg, self._facts = pkg, f
            if pkg is not None:
                rec.sha256 = pkg.sha256
            rec.step = "capacity"
            rec.need = Need(d.cfg.board.chips, f.weight_bytes if f else 0, f.kv_num_blocks if f else 0,
                            f.kv_bytes_per_block if f else 0)
            why = d.models.refuse_capacity(rec, rec.need)
            if why is not None:
                self._drain_first(why, now)
            self._phase = "drain_old" if self.drained is not None else "configure_start"
        if self._phase == "drain_old":
            if self.drained.state not in TERMINAL:
                return  # the old generation drains (requests for the alias get a retryable 503 meanwhile)
            self._phase = "configure_start"
        if self._phase == "configure_start":
            rec.step = "configure"
            d.models.transition(rec, M.CONFIGURING)
            self.generation = d.new_generation(rec, package_path=rec.path or None, package=self._pkg)
            self.generation.spawn()
            self._started = now
            self._phase = "configure"
        if self._phase == "configure":
            if not self.generation.startup_events():
                if now - self._started > STARTUP_TIMEOUT_S:
                    missing = [c for c in range(len(self.generation.links)) if c not in self.generation.infos]
                    raise LoadFailed("configure", f"workers of chips {missing} not ready within "
                                                  f"{STARTUP_TIMEOUT_S:.0f} s")
                return
            self.generation.build(now)
            if not rec.sha256 and self.generation.info is not None:
                rec.sha256 = self.generation.info.model_sha256
            d.models.transition(rec, M.WARMING)
            rec.step = "golden"
            self._cases = self._pkg.golden() if self._pkg is not None else []
            self._queue = list(range(len(self._cases)))
            self._started = now
            self._phase = "golden"
        if self._phase == "golden":
            # One case at a time: a case must give the package oracle's tokens alone, the way the oracle ran it
            # (llama.cpp may round a batched step differently: docs/models.md, known problems).
            if not self._pending and self._queue:
                i = self._queue.pop(0)
                self._submit(GenerateParams(**golden_check.golden_request(self._cases[i])), i, now)
            if self._pending:
                self._check_timeout(now)
                return
            outcomes = [golden_check.Outcome(tuple(self._outputs.get(i, ())), self._finish.get(i),
                                             self._errors.get(i)) for i in range(len(self._cases))]
            report = golden_check.check_cases(self._cases, outcomes, self.generation.info.eos_ids)
            failed = report.first_failure()
            if failed is not None or (self._cases and not report.ok):
                why = f"; {failed.name}: {failed.reason}" if failed is not None else ""
                raise LoadFailed("golden", report.summary + why, *STEP_ERRORS["golden"])
            rec.counters["golden_passed"] += report.count(golden_check.Status.PASS)
            rec.step = "warmup"
            prompt = list(self._cases[0]["prompt"]) if self._cases else [1, 2, 3]
            for _ in range(self.d.cfg.board.chips):
                self._submit(GenerateParams(prompt=prompt, max_tokens=WARMUP_TOKENS, ignore_eos=True), -1, now)
            self._phase = "warmup"
        if self._phase == "warmup":
            if self._pending:
                self._check_timeout(now)
                return
            if self._request_error is not None:
                raise self._request_error
            rec.step = "publish"
            self.previous = d.publish(self.generation, now)
            log("model_ready", model=rec.alias, generation=rec.id, package=rec.package, sha256=rec.sha256,
                kind=rec.kind, load_s=round(now - rec.created_at, 3), golden_cases=len(self._cases),
                previous=None if self.previous is None else self.previous.id)
            self._end()

    def _drain_first(self, why: str, now: float) -> None:
        """A replace/rollback that does not fit beside the generation it replaces: drain that one first.

        Raises LoadFailed("capacity") when it would not fit even then (or for a plain load)."""
        rec, d = self.rec, self.d
        prev = d.models.published.get(rec.alias) if rec.kind in ("replace", "rollback") else None
        if prev is None or d.models.refuse_capacity(rec, rec.need, excluding=(prev,)) is not None:
            raise LoadFailed("capacity", why, *STEP_ERRORS["capacity"])
        self.drained = d.models.generations[prev]
        log("model_drain_first", model=rec.alias, generation=rec.id, draining=prev, deadline_s=self.drain_s,
            reason="the board cannot hold both generations")
        d.begin_unload(self.drained, now=now, deadline_s=self.drain_s)

    def _check_timeout(self, now: float) -> None:
        if now - self._started > CHECK_TIMEOUT_S:
            raise LoadFailed(self.rec.step, f"{len(self._pending)} {self.rec.step} requests not answered "
                                            f"within {CHECK_TIMEOUT_S:.0f} s")

    def _submit(self, params: GenerateParams, case: int, now: float) -> None:
        rid = self.d.next_request_id()
        self._pending[rid] = case
        if case >= 0:
            self._outputs[case] = []
        self.d.open_internal(rid, self.generation, self)
        self.d.apply(self.generation.scheduler.submit(rid, params, now), self.generation, now)

    # -- the events of its own requests --------------------------------------------------------
    def on_event(self, a) -> None:
        case = self._pending.get(a.request_id)
        if case is None:
            return
        t = type(a)
        if t is EmitTokens:
            if case >= 0:
                self._outputs[case].extend(int(x) for x in a.tokens)
        elif t is FinishRequest:
            del self._pending[a.request_id]
            self.d.wake()  # the next step (or case) goes out on the next turn, not after a poll timeout
            if case >= 0:
                self._finish[case] = a.finish_reason
        elif t is FailRequest:
            del self._pending[a.request_id]
            self.d.wake()
            if case >= 0:
                self._errors[case] = f"{a.code} {a.reason}: {a.message}"
                return
            step = "warmup"
            if self._request_error is None:
                self._request_error = LoadFailed(step, f"{step} request failed: {a.code} {a.reason}: "
                                                       f"{a.message}", *STEP_ERRORS[step])

    # -- ending ----------------------------------------------------------------------------------
    def _fail(self, e: LoadFailed, now: float) -> None:
        rec = self.rec
        self.error = e
        log("model_load_failed", model=rec.alias, generation=rec.id, package=rec.package, step=e.step,
            error=e.message)
        for rid in list(self._pending):
            self.d.close_internal(rid)
        self._pending.clear()
        if self.generation is not None:
            self.d.drop_generation(self.generation)
        if self._future is not None:
            self._future.cancel()
        self.d.models.fail(rec, e.step, e.message)
        self._end()

    def _end(self) -> None:
        self.finished = True
        self.done(self)

    def abort(self, now: float, why: str) -> None:
        """The daemon stops: end the load as failed (its generation's resources are freed)."""
        if not self.finished:
            self._fail(LoadFailed(self.rec.step, why, 503, "shutdown"), now)
