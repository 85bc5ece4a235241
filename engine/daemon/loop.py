"""The daemon's single-threaded event loop: sockets in, core actions out.

Everything that changes state happens here, on one thread (DESIGN §2): the
zmq.Poller waits on the client ROUTER sockets, one control socket and one
result doorbell fd per chip and a self-pipe that signals write to; each
wake-up feeds what arrived into the sans-I/O scheduler core, calls `tick`,
and carries out the actions it returns. The poll timeout is the core's
`next_wakeup` bounded by the supervision period, so an idle daemon sleeps.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import os
import signal
import time
import traceback
from typing import Callable

import zmq

from engine.config import Config, ConfigError
from engine.core.actions import EmitTokens, FailRequest, FinishRequest, ReleaseBlocks, SubmitJob
from engine.core.model_state import ModelState
from engine.core.model_table import DrainVerdict, GenerationRecord, ModelTable
from engine.core.scheduler import Scheduler
from engine.daemon import ops
from engine.daemon.drain import DrainState
from engine.daemon.frontend import Frontend
from engine.daemon.liveness import LoopLiveness
from engine.daemon.load_report import load_report
from engine.daemon.log import log
from engine.daemon.sd_notify import Notifier
from engine.daemon.service import STOP_SIGNALS, Service
from engine.daemon.observe import MetricsPortBusy, Observers
from engine.daemon.models.generation import Generation
from engine.daemon.models.load_job import STARTUP_TIMEOUT_S, LoadJob
from engine.daemon.supervisor import Supervisor
from engine.exit_codes import EXIT_INTERNAL, EXIT_UNRECOVERABLE
from ipc.stale import reap_stale
from workers.backends.base import BackendInfo
from workers.chip_link import SHM_PREFIX, ChipLink

UNLOAD_STOP_TIMEOUT_S = 5.0  # an unloading generation's workers get this long to exit on SHUTDOWN, then SIGKILL
DEFAULT_DRAIN_S = 30.0  # unload/replace without deadline_s: server.drain_timeout_s


class StartupError(RuntimeError):
    """The daemon cannot start serving (worker start-up failure, model/config mismatch)."""


class Daemon:
    """One board: its model generations (workers + scheduler core each), frontend. `start()`, then `run()`."""

    def __init__(self, cfg: Config, *, package_path: str | None = None,
                 extra_backend_options: dict | None = None, clock: Callable[[], float] = time.monotonic,
                 notifier: Notifier | None = None, config_loader: Callable[[], Config] | None = None,
                 trace_path: str | None = None, models: list[tuple[str, str | None, bool]] | None = None) -> None:
        """`models`: what to load at start-up, [(alias, package, under_root)]; None = cfg.model.alias with
        `package_path` (the one-model daemon). `under_root`: the package is named relative to the model root
        and must not leave it; False for a package the operator gave as a path (--package, the built-in one)."""
        self.cfg = cfg
        self.trace_path = trace_path
        self.observe: Observers | None = None  # metrics and trace (engine/daemon/observe.py)
        self.package_path = package_path
        self.extra_backend_options = dict(extra_backend_options or {})
        self.clock = clock
        self.startup_models = models if models is not None else [(cfg.model.alias, package_path, False)]
        default = cfg.model.alias
        if self.startup_models and default not in [m[0] for m in self.startup_models]:
            default = self.startup_models[0][0]
        self.model_alias = default  # the board's default alias: requests without `model` get it
        self.models = ModelTable(default, cfg.board.memory_budget_mb << 20)
        self.generations: dict[int, Generation] = {}
        self.load_jobs: list[LoadJob] = []
        self.ctx: zmq.Context | None = None
        self.frontend: Frontend | None = None
        self.security = None  # engine.daemon.curve.CurveSetup when security.server_secret_key is set
        self.kv_events = None  # engine.daemon.kv_events.KvEventPublisher when kv_events.endpoint is set
        self.liveness = LoopLiveness(cfg.server.loop_stall_ms / 1000.0)
        self.accepting = True
        self.started_at = clock()
        self.exit_code = 0
        self._core_broken = False
        self._next_rid = 0
        self._stop_signal: int | None = None
        self._serving = False  # from run(): stop signals drain instead of stopping at once
        self.service = Service(self, notifier, config_loader)  # systemd notify, drain, reload
        self._poller = zmq.Poller()
        self._link_socks: dict[zmq.Socket | int, tuple[Generation, int]] = {}  # link socket / result fd -> (gen, chip)
        self._front_socks: dict[zmq.Socket, int] = {}
        self._rid_gen: dict[int, Generation] = {}  # every live request -> the generation it is pinned to
        self._internal: dict[int, LoadJob] = {}  # golden/warm-up requests -> their load job
        self._unload_waiters: dict[int, list[Callable[[GenerationRecord], None]]] = {}
        self._unloading: dict[int, float] = {}  # generation -> when its workers were asked to exit
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._sig_r = self._sig_w = -1
        self._old_handlers: dict[int, object] = {}
        self._old_wakeup_fd: int | None = None
        self._child_exited = False  # SIGCHLD arrived: supervise on this turn
        self._retired: dict[str, int] = {}  # counters of generations that are gone
        self.retired_entries: dict[int, dict] = {}  # the last `models` entries of unloaded generations
        self.counters = {"cancelled_dead_clients": 0}
        self.lifecycle_counts: collections.Counter = collections.Counter()  # (alias, op, outcome) -> n, for metrics

    # -- the default generation (what the one-model views show) -----------------------------
    def default_generation(self) -> Generation | None:
        gid = self.models.published.get(self.model_alias)
        if gid is None:
            live = [g for g in self.generations.values() if g.scheduler is not None]
            return live[0] if live else None
        return self.generations.get(gid)

    @property
    def scheduler(self) -> Scheduler | None:
        g = self.default_generation()
        return None if g is None else g.scheduler

    @property
    def supervisor(self) -> Supervisor | None:
        g = self.default_generation()
        return None if g is None else g.supervisor

    @property
    def links(self) -> list[ChipLink]:
        g = self.default_generation()
        return [] if g is None else g.links

    @property
    def info(self) -> BackendInfo | None:
        g = self.default_generation()
        return None if g is None else g.info

    @property
    def tokenizer(self):
        g = self.default_generation()
        return None if g is None else g.tokenizer

    def serving_generations(self) -> list[Generation]:
        """Generations whose scheduler runs (warming, ready, draining, recovering)."""
        return [g for g in self.generations.values() if g.scheduler is not None]

    # -- start-up -------------------------------------------------------------
    def start(self) -> None:
        """Load the start-up models through the load pipeline, then bind the frontend. Raises StartupError."""
        cfg = self.cfg
        self._install_signals()
        os.makedirs(cfg.board.runtime_dir, mode=0o700, exist_ok=True)
        for ep in cfg.server.endpoints:
            if ep.startswith("ipc://") and _socket_in_use(ep[len("ipc://"):]):
                raise StartupError(f"endpoint {ep} is in use by another running daemon")
        try:  # before any worker starts: a busy metrics port fails fast
            self.observe = Observers(cfg, trace_path=self.trace_path, t0=self.started_at)
        except MetricsPortBusy as e:
            raise StartupError(str(e)) from None
        except OSError as e:
            raise StartupError(f"cannot write the trace file {self.trace_path}: {e.strerror}") from None
        reaped = reap_stale(SHM_PREFIX)
        if reaped:
            log("reaped_stale_shm", count=len(reaped))
        self.ctx = zmq.Context()
        failures: list[LoadJob] = []
        for alias, package, under_root in self.startup_models:
            self.begin_load(alias, package or "", "startup", self.clock(),
                            lambda j: failures.append(j) if j.error else None,
                            package_path=None if under_root else package, resolve=under_root)
        next_supervise = self.clock()
        workers = cfg.board.chips * len(self.startup_models)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while any(not j.finished for j in self.load_jobs):
            if self._stop_signal is not None:
                raise StartupError("interrupted during start-up")
            ready = sum(len(g.infos) for g in self.generations.values())
            self.service.starting(time.monotonic(), ready, workers, deadline)
            next_supervise = self._turn(next_supervise, max_wait_s=0.2)
            if failures:
                break
        if failures:
            e = failures[0].error
            if e.step == "validate":
                raise ConfigError(e.message.split("; "))
            raise StartupError(e.message if len(self.startup_models) == 1 else f"{failures[0].rec.alias}: {e.message}")
        for ep in cfg.server.endpoints:
            if ep.startswith("ipc://"):
                _remove_stale_socket(ep[len("ipc://"):])
        if cfg.security.server_secret_key:
            from engine.daemon.curve import CurveSetup

            try:
                self.security = CurveSetup(self.ctx, server_secret_key=cfg.security.server_secret_key,
                                           client_keys_dir=cfg.security.client_keys_dir,
                                           admins=cfg.security.admins, forwarders=cfg.security.forwarders)
            except ValueError as e:
                raise StartupError(f"security: {e}") from None
        try:
            self.frontend = Frontend(self.ctx, list(cfg.server.endpoints),
                                     max_message_bytes=cfg.server.max_message_bytes,
                                     max_send_queue=cfg.server.max_send_queue, secure=self.security)
        except zmq.ZMQError as e:
            raise StartupError(f"cannot listen on {', '.join(cfg.server.endpoints)}: {e}") from None
        for i, s in enumerate(self.frontend.sockets):
            self._front_socks[s] = i
            self._poller.register(s, zmq.POLLIN)
            ep = cfg.server.endpoints[i]
            if ep.startswith("ipc://"):
                os.chmod(ep[len("ipc://"):], 0o600)
        if cfg.kv_events.endpoint:
            self._start_kv_events()
        self.started_at = self.clock()
        if cfg.metrics.port:
            log("metrics_serving", url=f"http://{cfg.metrics.host}:{self.observe.metrics.port}/metrics")
        log("serving", board=cfg.board.id, endpoints=list(cfg.server.endpoints), backend=cfg.board.backend,
            chips=cfg.board.chips, model=self.model_alias, models=sorted(self.models.published),
            pids=[lk.pid for g in self.generations.values() for lk in g.links])
        self.service.ready(self.clock())

    # -- generations (called by load jobs and ops) ---------------------------------------------
    def run_in_thread(self, fn) -> concurrent.futures.Future:
        """Run blocking work (hashing a package) off the loop; its end wakes the loop."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-load")
        fut = self._executor.submit(fn)
        fut.add_done_callback(lambda _f: self.wake())
        return fut

    def wake(self) -> None:
        """Make the loop turn again at once (from any thread: a byte on the self-pipe)."""
        if self._sig_w >= 0:
            try:
                os.write(self._sig_w, b"\0")
            except OSError:
                pass

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
                       extra_backend_options=self.extra_backend_options, register=self._register_link,
                       unregister=self._unregister_link, observe=lambda: self.observe)
        self.generations[rec.id] = g
        return g

    def publish(self, g: Generation, now: float) -> GenerationRecord | None:
        """The alias flips to `g` (one assignment); returns the generation it replaced (to drain)."""
        g.cfg = self.cfg  # a SIGHUP during the load: the running configuration
        g.serve(self.accepting)
        return self.models.publish(g.rec, now)

    def drop_generation(self, g: Generation) -> None:
        """A failed load: fail its requests (the load's own), stop its workers, free its rings."""
        now = self.clock()
        if g.scheduler is not None:
            self.apply(g.scheduler.shutdown(now), g, now)
        for rid in [r for r, gg in self._rid_gen.items() if gg is g]:
            self._rid_gen.pop(rid, None)
            self._internal.pop(rid, None)
        g.stop()
        self._retire(g)

    def _retire(self, g: Generation) -> None:
        for k, v in g.counters.items():
            self._retired[k] = self._retired.get(k, 0) + v
        self.generations.pop(g.id, None)

    def begin_unload(self, rec: GenerationRecord, *, now: float, deadline_s: float,
                     waiter: Callable[[GenerationRecord], None] | None = None) -> None:
        """Ready -> Draining: no new requests; those in flight finish until the deadline (then `_drains`)."""
        self.models.begin_drain(rec, now, deadline_s)
        log("model_draining", model=rec.alias, generation=rec.id, deadline_s=deadline_s,
            active_requests=len(self.generations[rec.id].rids))
        if waiter is not None:
            self._unload_waiters.setdefault(rec.id, []).append(waiter)
        self._drains(now)

    def _drains(self, now: float) -> None:
        """Move draining, recovering and unloading generations on (every supervision tick and after unloads)."""
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
                self.retired_entries[g.id] = self.model_entry(g.rec)
                while len(self.retired_entries) > 64:
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

    # -- poller registration ----------------------------------------------------------------
    def _register_link(self, g: Generation, chip: int) -> None:
        lk = g.links[chip]
        assert lk.socket is not None and lk.result_fd is not None
        for s in (lk.socket, lk.result_fd):  # a restarted link has a new socket and a new fd
            self._link_socks[s] = (g, chip)
            self._poller.register(s, zmq.POLLIN)

    def _unregister_link(self, g: Generation, chip: int) -> None:
        for s, (gg, c) in list(self._link_socks.items()):
            if gg is g and c == chip:
                self._poller.unregister(s)
                del self._link_socks[s]

    def _install_signals(self) -> None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._sig_r, self._sig_w = r, w
        self._old_wakeup_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS + self.service.extra_signals():
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        self._old_handlers[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, self._on_child_exit)
        self._poller.register(r, zmq.POLLIN)

    def _on_child_exit(self, signum, frame) -> None:
        self._child_exited = True  # the wake-up fd wakes the loop; it supervises (reaping is the link's job)

    def _on_signal(self, signum, frame) -> None:
        if self._serving:
            self.service.pending.append(signum)  # handled on the loop thread: drain, reload
        elif signum in STOP_SIGNALS:
            self._stop_signal = signum  # interrupts start-up

    def request_stop(self, signum: int | None) -> None:
        """End the loop after this turn (the drain is over); shutdown ends what is left."""
        self._stop_signal = signum if signum is not None else signal.SIGTERM

    @property
    def stop_requested(self) -> bool:
        return self._stop_signal is not None

    def _start_kv_events(self) -> None:
        from engine.daemon.kv_events import KvEventPublisher, prefix_caches

        ep = self.cfg.kv_events.endpoint
        g = self.default_generation()
        caches = prefix_caches(g.scheduler) if g is not None and g.scheduler is not None else {}
        try:
            self.kv_events = KvEventPublisher(self.ctx, ep, self.cfg.kv_events.topic, caches, owner=g)
        except zmq.ZMQError as e:
            raise StartupError(f"cannot publish KV events on {ep}: {e}; set kv_events.endpoint to a free "
                               "address (or \"\" to turn them off)") from None
        log("kv_events_publishing", endpoint=ep, block_size=sorted({c.block_size for c in caches.values()}))

    # -- the loop ------------------------------------------------------------------
    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (exit 0) or an unrecoverable failure (non-zero)."""
        assert self.frontend is not None
        self._serving = True
        try:
            self._serve(self.clock())
        except Exception as e:  # a core or shell bug: the state can no longer be trusted
            log("fatal", reason="internal error", error=repr(e), traceback=traceback.format_exc())
            self.exit_code = EXIT_INTERNAL
            self._core_broken = True
        return self._shutdown()

    def _serve(self, next_supervise: float) -> None:
        while self._stop_signal is None and self.exit_code == 0:
            next_supervise = self._turn(next_supervise)

    def _turn(self, next_supervise: float, max_wait_s: float | None = None) -> float:
        """One wake-up: poll, feed what arrived to the cores, tick them, carry out their actions."""
        fe, live, service = self.frontend, self.liveness, self.service
        front_socks, link_socks = self._front_socks, self._link_socks
        gens = self.serving_generations()
        now = self.clock()
        until = next_supervise
        for g in gens:
            wake = g.scheduler.next_wakeup(now)
            if wake is not None and wake < until:
                until = wake
        ping = service.wake_by()
        if ping is not None and ping < until:
            until = ping
        timeout_ms = max(0, math.ceil((until - now) * 1000))
        if max_wait_s is not None:
            timeout_ms = min(timeout_ms, int(max_wait_s * 1000))
        live.sleeping(now)
        events = self._poller.poll(timeout_ms)
        now = self.clock()
        live.woke(now)
        n_actions = 0
        for sock, _ in events:
            if sock in link_socks:
                g, chip = link_socks[sock]
                if g.scheduler is None:
                    continue  # still configuring: its load job reads the start-up messages
                acts = g.on_link(chip, now)
                n_actions += len(acts)
                self.apply(acts, g, now)
            elif sock in front_socks:
                for conn, msg in fe.receive(front_socks[sock]):
                    fe.handle_guarded(ops.handle, self, conn, msg, now)
            elif sock == self._sig_r:
                _drain_fd(self._sig_r)
        if fe is not None:
            service.turn(now)
        for job in list(self.load_jobs):
            job.poll(now)
        if self._child_exited:
            self._child_exited = False
            next_supervise = now
        if now >= next_supervise:
            for g in self.serving_generations():
                if g.rec.state in (ModelState.UNLOADING, ModelState.RECOVERING):
                    continue  # no restarts: it is going away (its job timeout ends a hung job)
                acts = g.supervise(now)
                n_actions += len(acts)
                self.apply(acts, g, now)
            if self.generations and all(g.all_out() for g in self.serving_generations()) \
                    and self.serving_generations():
                log("fatal", reason="every chip is out of service")
                self.exit_code = EXIT_UNRECOVERABLE
            self._drains(now)
            # Heartbeat silence and start-up timeouts. A worker's exit does not wait for this: its SIGCHLD
            # wakes the loop. Every idle wake-up takes CPU from a CPU backend's compute threads.
            next_supervise = now + self.cfg.recovery.supervise_interval_ms / 1000.0
        elif self._unloading or (self.models.next_deadline() is not None and now >= self.models.next_deadline()):
            self._drains(now)
        if fe is not None:
            self.observe.publish(self, now)  # at most every PUBLISH_INTERVAL_S: busy turns keep the snapshot fresh
        blocked = None
        for g in self.serving_generations():
            g.retry_backlog()
            acts = g.scheduler.tick(now)
            n_actions += len(acts)
            self.apply(acts, g, now)
            blocked = blocked or g.scheduler.admission_blocked
        if self.kv_events is not None:
            self.kv_events.follow(self.default_generation())
            self.kv_events.flush()
        if fe is not None:
            dead = fe.flush()
            if dead:
                self._cancel_dead(dead, now)
        trace = self.observe.trace if self.observe is not None else None
        if trace is not None:
            trace.turn(now, self.clock(), len(events), n_actions, blocked)
        return next_supervise

    # -- requests -------------------------------------------------------------------------
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
        self._internal[rid] = job

    def close_internal(self, rid: int) -> None:
        self._internal.pop(rid, None)
        g = self._rid_gen.pop(rid, None)
        if g is not None:
            g.rids.discard(rid)

    def _ended(self, rid: int, ok: bool) -> None:
        g = self._rid_gen.pop(rid, None)
        if g is not None:
            g.rids.discard(rid)
            g.rec.active_requests = len(g.rids)
            g.rec.counters["completed" if ok else "failed"] += 1

    def apply(self, actions: list, g: Generation, now: float | None = None) -> None:
        """Carry out the actions generation `g`'s scheduler returned."""
        if not actions:
            return
        internal = self._internal
        if self.observe is not None:
            self.observe.on_actions(actions, self.clock() if now is None else now, g.id, g.alias, internal)
        fe = self.frontend
        for a in actions:
            t = type(a)
            if t is SubmitJob:
                g.submit(a.chip, a.job)
                continue
            if t is ReleaseBlocks:
                g.release(a.chip, a.blocks)
                continue
            rid = a.request_id
            job = internal.get(rid) if internal else None
            if job is not None:
                job.on_event(a)
                if t is not EmitTokens:
                    internal.pop(rid, None)
                    self._ended(rid, t is FinishRequest)
                continue
            if t is EmitTokens:
                fe.emit(rid, a.tokens, a.logprobs, a.text)
            elif t is FinishRequest:
                fe.finish(rid, a.finish_reason, a.usage, a.timing)
                self._ended(rid, True)
            elif t is FailRequest:
                fe.fail(rid, a.code, a.reason, a.message, a.retryable)
                if a.timing is None and rid in self._rid_gen:
                    g.rec.counters["rejected"] += 1
                self._ended(rid, False)
            else:
                raise AssertionError(f"unknown action {a!r}")

    def _cancel_dead(self, rids: list[int], now: float) -> None:
        """Requests of clients that vanished or stopped reading: free their lanes."""
        self.counters["cancelled_dead_clients"] += len(rids)
        for rid in rids:
            g = self._rid_gen.get(rid)
            if g is not None and g.scheduler is not None:
                self.apply(g.scheduler.cancel(rid, now), g, now)  # their events go nowhere
        self.frontend.flush()

    # -- replies ---------------------------------------------------------------------
    def next_request_id(self) -> int:
        self._next_rid += 1
        return self._next_rid

    def set_accepting(self, accepting: bool) -> None:
        if self.service.drain.state is not DrainState.SERVING:
            accepting = False  # an admin `resume` cannot undo a SIGTERM drain
        self.accepting = accepting
        for g in self.serving_generations():
            if g.rec.state is ModelState.READY:  # a load's golden cases run whatever the board admits
                g.scheduler.set_accepting(accepting, "draining")

    def model_info(self) -> dict:
        g = self.default_generation()
        if g is None:
            return {"alias": self.model_alias, "backend": self.cfg.board.backend, "generation": None}
        return g.model_info()

    def model_entry(self, rec: GenerationRecord) -> dict:
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

    def models_list(self) -> list[dict]:
        return [self.model_entry(r) for r in sorted(self.models.generations.values(), key=lambda r: r.id)]

    def chips_info(self, now: float) -> list[dict]:
        g = self.default_generation()
        return [] if g is None else g.chips_info(now)

    def board_counters(self) -> dict:
        out = dict(self._retired)
        for g in self.generations.values():
            for k, v in g.counters.items():
                out[k] = out.get(k, 0) + v
        for k in ("jobs_submitted", "ring_full", "results", "chip_failures", "worker_restarts"):
            out.setdefault(k, 0)
        return out | self.counters

    def health(self, now: float) -> dict:
        g = self.default_generation()
        up = g.supervisor.in_service() if g is not None and g.supervisor is not None else []
        loop_ok = self.liveness.healthy(now)
        return {
            "ok": bool(up) and loop_ok and self.accepting,
            "accepting": self.accepting,
            "loop_ok": loop_ok,
            "loop_lag_ms": round(self.liveness.lag_s(now) * 1000, 3),
            "chips_up": len(up),
            "chips": self.chips_info(now),
            "model": self.model_info(),
            "models": sorted(self.models.published),
            "board": self.cfg.board.id,
            "pid": os.getpid(),
            "uptime_s": round(now - self.started_at, 3),
            "active_requests": self.frontend.active(),
            "load": load_report(self.scheduler.stats()) if self.scheduler is not None else None,
        }

    def stats(self, now: float) -> dict:
        sched = self.scheduler
        return {
            "scheduler": sched.stats(now) if sched is not None else None,
            "metrics": self.observe.families(self, now),
            "frontend": self.frontend.counters.as_dict(),
            "daemon": dict(self.board_counters(), active_requests=self.frontend.active(),
                           loop_turns=self.liveness.turns,
                           loop_max_turn_ms=round(self.liveness.max_turn_s * 1000, 3)),
            "chips": self.chips_info(now),
            "models": [dict(self.model_entry(g.rec), scheduler=g.scheduler.stats(now) if g.scheduler else None,
                            chips=g.chips_info(now)) for g in sorted(self.generations.values(), key=lambda g: g.id)],
            "uptime_s": round(now - self.started_at, 3),
        }

    # -- shutdown ------------------------------------------------------------------
    def _shutdown(self) -> int:
        """Every live request gets its terminal event, then workers and shm go away."""
        now = self.clock()
        reason = "signal" if self._stop_signal is not None else "fatal"
        log("stopping", reason=reason, signal=self._stop_signal, active_requests=self.frontend.active())
        self.service.stopping(reason)
        self.accepting = False
        if not self._core_broken:
            try:
                for job in list(self.load_jobs):
                    job.abort(now, "the daemon is shutting down")
                for g in self.serving_generations():
                    g.scheduler.set_accepting(False, "shutdown")
                    self.apply(g.scheduler.shutdown(now), g, now)
            except Exception as e:
                log("fatal", reason="shutdown of the core failed", error=repr(e))
                self.exit_code = self.exit_code or EXIT_INTERNAL
        # Whatever the core managed, no accepted request may end without its terminal event.
        self.frontend.fail_all(503 if self.exit_code == 0 else 500, "shutdown" if self.exit_code == 0 else "internal",
                               "the daemon is shutting down")
        self.frontend.flush()
        self.close()
        log("stopped", exit_code=self.exit_code)
        return self.exit_code

    def close(self) -> None:
        """Release everything (idempotent; also the clean-up path of a failed start)."""
        if self.frontend is not None:
            for s in list(self._front_socks):
                self._poller.unregister(s)
            self._front_socks.clear()
            self.frontend.close(linger_ms=1000)  # let the terminal events leave
        for g in list(self.generations.values()):
            g.kill() if g.rec.state is ModelState.RECOVERING else None  # a hung job: SIGKILL, then free
            g.stop()
        self.generations.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        if self._sig_r >= 0:
            for sig, h in self._old_handlers.items():
                signal.signal(sig, h)
            self._old_handlers.clear()
            signal.set_wakeup_fd(self._old_wakeup_fd if self._old_wakeup_fd is not None else -1)
            try:
                self._poller.unregister(self._sig_r)
            except KeyError:
                pass
            os.close(self._sig_r)
            os.close(self._sig_w)
            self._sig_r = self._sig_w = -1
        self.service.close()
        if self.observe is not None:
            self.observe.close()
            self.observe = None
        if self.security is not None:
            self.security.stop()
            self.security = None
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.ctx is not None:
            for ep in self.cfg.server.endpoints:
                if ep.startswith("ipc://"):
                    _remove_stale_socket(ep[len("ipc://"):])
            self.ctx.term()
            self.ctx = None


def _drain_fd(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _socket_in_use(path: str) -> bool:
    """True when something accepts connections on the unix socket `path`."""
    import socket

    if not os.path.exists(path):
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(0.5)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _remove_stale_socket(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
