"""The board's model generations: their lifecycle, their drains, and which request runs on which.

One registry per daemon, loop thread only. It loads (through a `LoadJob`),
publishes, drops and unloads generations, moves draining ones on every
supervision tick, and pins every live request to the generation it was
admitted under. It owns no socket and no poller: the loop hands it the
callables it needs (`apply` to carry out a scheduler's actions, `wake` to turn
the loop again, `register`/`unregister` for a link's socket and doorbell), so
it holds the lifecycle rules and nothing of the transport.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable

from engine.config import Config
from engine.core.model_state import ModelState
from engine.core.model_table import DrainVerdict, GenerationRecord, ModelTable
from engine.daemon.log import log
from engine.daemon.lora_registry import LoraRegistry
from engine.daemon.models.generation import ChipObserver, Generation
from engine.daemon.models.load_job import LoadJob

UNLOAD_STOP_TIMEOUT_S = 5.0  # an unloading generation's workers get this long to exit on SHUTDOWN, then SIGKILL
RETIRED_ENTRIES = 64  # `models` entries of unloaded generations kept (a replace's reply names the previous one)

Apply = Callable[[list, Generation, float], None]


class Generations:
    """Every model generation of one board, the model table over them, and the request pins."""

    def __init__(self, cfg: Config, default_alias: str, *, clock: Callable[[], float], apply: Apply,
                 wake: Callable[[], None], register: Callable[[Generation, int], None],
                 unregister: Callable[[Generation, int], None], observe: Callable[[], ChipObserver | None],
                 extra_backend_options: dict | None = None) -> None:
        self.cfg = cfg  # the running configuration (a SIGHUP reload replaces it: engine/daemon/lifecycle/service.py)
        self.ctx = None  # the loop's zmq.Context, set at start-up (the workers' sockets)
        self.clock = clock
        self.model_alias = default_alias  # the board's default alias: requests without `model` get it
        self.models = ModelTable(default_alias, cfg.board.memory_budget_mb << 20)
        self.generations: dict[int, Generation] = {}
        self.load_jobs: list[LoadJob] = []
        self.accepting = True  # the board admits new requests (drain/resume, SIGTERM)
        self.drain_deadline: float | None = None  # an admin drain's end: what is still live then gets 503
        self.reopen_at: float | None = None  # while not accepting: the drain's end (the refusals' retry_after_ms)
        self.extra_backend_options = dict(extra_backend_options or {})
        self._apply, self.wake = apply, wake
        self._register, self._unregister, self._observe = register, unregister, observe
        self._next_rid = 0
        self._rid_gen: dict[int, Generation] = {}  # every live request -> the generation it is pinned to
        self.internal: dict[int, LoadJob] = {}  # golden/warm-up requests -> their load job
        self._unload_waiters: dict[int, list[Callable[[GenerationRecord], None]]] = {}
        self._unloading: dict[int, float] = {}  # generation -> when its workers were asked to exit
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.retired_counters: dict[str, int] = {}  # counters of generations that are gone
        self.retired_entries: dict[int, dict] = {}  # the last `models` entries of unloaded generations
        self.lifecycle_counts: collections.Counter = collections.Counter()  # (alias, op, outcome) -> n, for metrics
        self.lora = LoraRegistry(self)  # the board's LoRA adapters (engine/daemon/lora_registry.py)

    # -- which generations -----------------------------------------------------------------
    def default_generation(self) -> Generation | None:
        """The default alias's generation (what the one-model views show)."""
        gid = self.models.published.get(self.model_alias)
        if gid is None:
            live = [g for g in self.generations.values() if g.scheduler is not None]
            return live[0] if live else None
        return self.generations.get(gid)

    def serving_generations(self) -> list[Generation]:
        """Generations whose scheduler runs (warming, ready, draining, recovering)."""
        return [g for g in self.generations.values() if g.scheduler is not None]

    def entry(self, rec: GenerationRecord) -> dict:
        """One `models` entry: the generation's state, package and counters (plus model_info's keys)."""
        g = self.generations.get(rec.id)
        out = g.model_info() if g is not None else {"alias": rec.alias, "backend": self.cfg.board.backend}
        out.update(alias=rec.alias, generation=rec.id, state=rec.state.value, package=rec.package,
                   path=rec.path or None,
                   sha256=rec.sha256 or out.get("sha256", ""),
                   default=rec.alias == self.model_alias and self.models.published.get(rec.alias) == rec.id,
                   active_requests=len(g.rids) if g is not None else 0,
                   counters=rec.default_counters | {"golden_passed": int(rec.counters.get("golden_passed", 0))},
                   error=rec.error, step=rec.step,
                   memory_bytes=rec.need.memory_bytes if rec.need is not None else None)
        return out

    # -- admission -------------------------------------------------------------------------
    def set_accepting(self, accepting: bool, reopen_at: float | None = None) -> None:
        """`reopen_at`: when a refused request may come back (a drain's deadline; None: not known)."""
        self.accepting = accepting
        self.reopen_at = None if accepting else reopen_at
        if accepting:
            self.drain_deadline = None
        for g in self.serving_generations():
            if g.rec.state is ModelState.READY:  # a load's golden cases run whatever the board admits
                g.scheduler.set_accepting(accepting, "draining", self.reopen_at)

    # -- loads (called by the admin ops and the load jobs) ------------------------------------
    def run_in_thread(self, fn) -> concurrent.futures.Future:
        """Run blocking work (hashing a package) off the loop; its end wakes the loop."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-load")
        fut = self._executor.submit(fn)
        fut.add_done_callback(lambda _f: self.wake())
        return fut

    def apply(self, actions: list, g: Generation, now: float) -> None:
        """Carry out the actions of `g`'s scheduler (the loop's job; here for the load jobs and drains)."""
        self._apply(actions, g, now)

    def begin_load(self, alias: str, package: str, kind: str, now: float, done: Callable[[LoadJob], None], *,
                   package_path: str | None = None, deadline_s: float | None = None,
                   resolve: bool | None = None) -> LoadJob:
        """Start a load/replace/rollback/startup job; raises model_table.LifecycleError when it may not start.

        `package_path`: already resolved (start-up, rollback): not looked up under the model root again."""
        rec = self.models.begin(alias, package, kind, now)
        if package_path is not None:
            rec.path = package_path

        def finished(job: LoadJob) -> None:
            self.load_jobs.remove(job)
            self.lifecycle_counts[(alias, kind, "failed" if job.error else "ready")] += 1
            if job.error is None and job.previous is not None:
                self.begin_unload(job.previous, now=self.clock(),
                                  deadline_s=self.cfg.server.drain_timeout_s if deadline_s is None else deadline_s)
            done(job)  # a failed generation stays listed (state failed, its error) until the alias's next op

        drain_s = self.cfg.server.drain_timeout_s if deadline_s is None else deadline_s
        job = LoadJob(self, rec, done=finished, package_path=package_path,
                      resolve=kind in ("load", "replace") if resolve is None else resolve, drain_s=drain_s)
        self.load_jobs.append(job)
        job.start(now)
        return job

    def new_generation(self, rec: GenerationRecord, *, package_path: str | None, package) -> Generation:
        g = Generation(rec, self.cfg, self.ctx, package_path=package_path, package=package,
                       extra_backend_options=self.extra_backend_options, register=self._register,
                       unregister=self._unregister, observe=self._observe)
        self.generations[rec.id] = g
        return g

    def publish(self, g: Generation, now: float) -> GenerationRecord | None:
        """The alias flips to `g` (one assignment); returns the generation it replaced (to drain)."""
        g.cfg = self.cfg  # a SIGHUP during the load: the running configuration
        g.serve(self.accepting, self.reopen_at)
        return self.models.publish(g.rec, now)

    def drop_generation(self, g: Generation) -> None:
        """A failed load: fail its requests (the load's own), stop its workers, free its rings."""
        now = self.clock()
        if g.scheduler is not None:
            self.apply(g.scheduler.shutdown(now), g, now)
        for rid in [r for r, gg in self._rid_gen.items() if gg is g]:
            self._rid_gen.pop(rid, None)
            self.internal.pop(rid, None)
        g.stop()
        self._retire(g)

    def _retire(self, g: Generation) -> None:
        for k, v in g.counters.items():
            self.retired_counters[k] = self.retired_counters.get(k, 0) + v
        self.generations.pop(g.id, None)

    # -- unloads and drains ------------------------------------------------------------------------
    def begin_unload(self, rec: GenerationRecord, *, now: float, deadline_s: float,
                     waiter: Callable[[GenerationRecord], None] | None = None) -> None:
        """Ready -> Draining: no new requests; those in flight finish until the deadline (then `drains`)."""
        self.models.begin_drain(rec, now, deadline_s)
        log("model_draining", model=rec.alias, generation=rec.id, deadline_s=deadline_s,
            active_requests=len(self.generations[rec.id].rids))
        if waiter is not None:
            self._unload_waiters.setdefault(rec.id, []).append(waiter)
        self.drains(now)

    def drain_board(self, now: float, timeout_s: float) -> None:
        """Admin `drain`: admission closes; requests still live `timeout_s` from now are ended (`drains`)."""
        self.drain_deadline = now + timeout_s
        if not self.accepting:  # refusals meanwhile say when to come back: the drain's end
            self.set_accepting(False, self.reopen_at if self.reopen_at is not None else self.drain_deadline)

    def drains_due(self, now: float) -> bool:
        """Between supervision ticks: an unload waits for its workers, or a drain deadline has passed."""
        deadline = self.models.next_deadline()
        return bool(self._unloading) or (deadline is not None and now >= deadline) \
            or (self.drain_deadline is not None and now >= self.drain_deadline)

    def drains(self, now: float) -> None:
        """Move draining, recovering and unloading generations on (every supervision tick and after unloads)."""
        if self.drain_deadline is not None and now >= self.drain_deadline:
            self.drain_deadline = None
            ended = 0
            for g in self.serving_generations():
                if g.rec.state is ModelState.READY:
                    acts = g.scheduler.end_live(now, "the board was drained and its drain timeout passed")
                    ended += len(acts)
                    self.apply(acts, g, now)
            log("drain_timed_out", ended_requests=ended)
        for g in list(self.generations.values()):
            st = g.rec.state
            if st is ModelState.DRAINING:
                verdict = self.models.drain_verdict(g.rec, now, len(g.rids), g.inflight_jobs())
                if verdict in (DrainVerdict.DEADLINE, DrainVerdict.RECOVER):  # cancel what is left
                    for rid in list(g.rids):
                        self.apply(g.scheduler.cancel(rid, now), g, now)
                    verdict = self.models.drain_verdict(g.rec, now, len(g.rids), g.inflight_jobs())
                if verdict is DrainVerdict.DONE:
                    self._begin_stop(g, now)
                elif verdict in (DrainVerdict.RECOVER, DrainVerdict.DEADLINE):
                    self.models.transition(g.rec, ModelState.RECOVERING)
                    log("model_recovering", model=g.alias, generation=g.id, inflight_jobs=g.inflight_jobs(),
                        note="buffers stay allocated until no job can write them")
                    self._notify_unloaded(g.rec)
            elif st is ModelState.RECOVERING:
                # The core times out jobs that never come back (executor.job_timeout_ms); the workers are
                # stopped (SIGKILL if they do not exit) before any ring is freed.
                if g.inflight_jobs() == 0 or not g.workers_alive():
                    self._begin_stop(g, now)
            elif st is ModelState.UNLOADING:
                asked = self._unloading[g.id]
                if g.workers_alive():
                    if now - asked >= UNLOAD_STOP_TIMEOUT_S:
                        g.kill()  # a hung job: SIGKILL; its rings are freed once it is dead (a later turn)
                    continue
                g.stop()  # the workers have exited: now rings, sockets and fds go
                self._unloading.pop(g.id, None)
                self.models.transition(g.rec, ModelState.UNLOADED)
                log("model_unloaded", model=g.alias, generation=g.id,
                    unload_s=round(now - (g.rec.drain_started_at or now), 3))
                self._retire(g)
                self._notify_unloaded(g.rec)
                self.retired_entries[g.id] = self.entry(g.rec)
                while len(self.retired_entries) > RETIRED_ENTRIES:
                    del self.retired_entries[next(iter(self.retired_entries))]
                self.models.forget(g.rec)

    def _begin_stop(self, g: Generation, now: float) -> None:
        self.models.transition(g.rec, ModelState.UNLOADING)
        if g.scheduler is not None:
            self.apply(g.scheduler.shutdown(now), g, now)
        for lk in g.links:
            lk.request_stop()
        self._unloading[g.id] = now

    def _notify_unloaded(self, rec: GenerationRecord) -> None:
        self.lifecycle_counts[(rec.alias, "unload", rec.state.value)] += 1
        for w in self._unload_waiters.pop(rec.id, []):
            w(rec)

    # -- request pinning ------------------------------------------------------------------------
    def next_request_id(self) -> int:
        self._next_rid += 1
        return self._next_rid

    def admit(self, rid: int, g: Generation) -> None:
        """Pin request `rid` to generation `g` for its whole life."""
        self._rid_gen[rid] = g
        g.rids.add(rid)
        g.rec.active_requests = len(g.rids)
        g.rec.counters["requests"] += 1

    def generation_of(self, rid: int) -> Generation | None:
        return self._rid_gen.get(rid)

    def open_internal(self, rid: int, g: Generation, job: LoadJob) -> None:
        self.admit(rid, g)
        self.internal[rid] = job

    def close_internal(self, rid: int) -> None:
        self.internal.pop(rid, None)
        g = self._rid_gen.pop(rid, None)
        if g is not None:
            g.rids.discard(rid)

    def ended(self, rid: int, ok: bool) -> None:
        """Request `rid` got its terminal event: unpin it, count it for its generation."""
        g = self._rid_gen.pop(rid, None)
        if g is not None:
            g.rids.discard(rid)
            g.rec.active_requests = len(g.rids)
            g.rec.counters["completed" if ok else "failed"] += 1

    # -- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every generation's workers and free its rings (idempotent)."""
        for g in list(self.generations.values()):
            g.kill() if g.rec.state is ModelState.RECOVERING else None  # a hung job: SIGKILL, then free
            g.stop()
        self.generations.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
