"""The daemon's single-threaded event loop: sockets in, core actions out.

Everything that changes state happens here, on one thread (one owner of the state, so no locks): the
zmq.Poller waits on the client ROUTER sockets, one control socket and one
result doorbell fd per chip and a self-pipe that signals write to; each
wake-up feeds what arrived into the sans-I/O scheduler core, calls `tick`,
and carries out the actions it returns. The poll timeout is the core's
`next_wakeup` bounded by the supervision period, so an idle daemon sleeps.

The loop holds the turn, `apply`, signals and start/stop only: the model
generations and the requests pinned to them are the registry's
(engine/daemon/generations.py), the health/stats/models answers the views'
(engine/daemon/views.py); each collaborator is handed the narrow object it
needs, so nothing but the construction site (main.py) imports this module.
"""

from __future__ import annotations

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
from engine.core.model_table import ModelTable
from engine.core.retry_after import NOT_READY_RETRY_S, clamp_ms
from engine.daemon import ops
from engine.daemon.chip_link import SHM_PREFIX
from engine.daemon.frontend import Frontend
from engine.daemon.generations import Generations
from engine.daemon.heap_trim import HeapTrimmer
from engine.daemon.lifecycle.drain import DrainState
from engine.daemon.lifecycle.liveness import LoopLiveness
from engine.daemon.lifecycle.sd_notify import Notifier
from engine.daemon.lifecycle.service import STOP_SIGNALS, Service
from engine.daemon.lifecycle.signal_pipe import SignalPipe
from engine.daemon.log import log
from engine.daemon.models.generation import Generation
from engine.daemon.models.load_job import STARTUP_TIMEOUT_S, LoadJob
from engine.daemon.observability.observers import MetricsPortBusy, Observers
from engine.daemon.views import Views
from engine.exit_codes import EXIT_INTERNAL, EXIT_UNRECOVERABLE
from ipc.stale import reap_stale



class StartupError(RuntimeError):
    """The daemon cannot start serving (worker start-up failure, model/config mismatch)."""


class Daemon:
    """One board: its generations registry, views and frontend, turned by one loop. `start()`, then `run()`."""

    def __init__(self, cfg: Config, *, package_path: str | None = None,
                 extra_backend_options: dict | None = None, clock: Callable[[], float] = time.monotonic,
                 notifier: Notifier | None = None, config_loader: Callable[[], Config] | None = None,
                 trace_path: str | None = None, models: list[tuple[str, str | None, bool]] | None = None) -> None:
        """`models`: what to load at start-up, [(alias, package, under_root)]; None = cfg.model.alias with
        `package_path` (the one-model daemon). `under_root`: the package is named relative to the model root
        and must not leave it; False for a package the operator gave as a path (--package, the built-in one)."""
        self.trace_path = trace_path
        self.observe: Observers | None = None  # metrics and trace (engine/daemon/observability/observers.py)
        self.clock = clock
        self.startup_models = models if models is not None else [(cfg.model.alias, package_path, False)]
        default = cfg.model.alias
        if self.startup_models and default not in [m[0] for m in self.startup_models]:
            default = self.startup_models[0][0]
        self.gens = Generations(cfg, default, clock=clock, apply=self.apply, wake=self.wake,
                                register=self._register_link, unregister=self._unregister_link,
                                observe=lambda: self.observe, extra_backend_options=extra_backend_options)
        self.views: Views | None = None  # once the frontend is bound (start)
        self.ctx: zmq.Context | None = None
        self.frontend: Frontend | None = None
        self._ops: ops.OpContext | None = None
        self.security = None  # engine.daemon.curve.CurveSetup when security.server_secret_key is set
        self.kv_events = None  # engine.daemon.kv_events.KvEventPublisher when kv_events.endpoint is set
        self.transfers = None  # engine.daemon.handoff.transfer.Transfers: KV pulls between boards
        self.liveness = LoopLiveness(cfg.server.loop_stall_ms / 1000.0)
        self.started_at = clock()
        self.exit_code = 0
        self._core_broken = False
        self._stop_signal: int | None = None
        self._serving = False  # from run(): stop signals drain instead of stopping at once
        self.service = Service(self, self.gens, self.liveness, notifier, config_loader)  # systemd, drain, reload
        self._poller = zmq.Poller()
        self._link_socks: dict[zmq.Socket | int, tuple[Generation, int]] = {}  # link socket / result fd -> (gen, chip)
        self._front_socks: dict[zmq.Socket, int] = {}
        self._signals = SignalPipe()
        self._child_exited = False  # SIGCHLD arrived: supervise on this turn
        self.counters = {"cancelled_dead_clients": 0}
        self.heap_trim = HeapTrimmer(cfg.board.malloc_trim_interval_s, self.clock())

    @property
    def cfg(self) -> Config:
        """The running configuration (its one home is the registry: a reload replaces it there)."""
        return self.gens.cfg

    @property
    def models(self) -> ModelTable:
        """The model table (the construction site prints what is served)."""
        return self.gens.models

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
        self.ctx = self.gens.ctx = zmq.Context()
        failures: list[LoadJob] = []
        for alias, package, under_root in self.startup_models:
            self.gens.begin_load(alias, package or "", "startup", self.clock(),
                                 lambda j: failures.append(j) if j.error else None,
                                 package_path=None if under_root else package, resolve=under_root)
        next_supervise = self.clock()
        workers = cfg.board.replicas * len(self.startup_models)  # `infos` counts a TP replica once
        deadline = self.clock() + STARTUP_TIMEOUT_S
        while any(not j.finished for j in self.gens.load_jobs):
            if self._stop_signal is not None:
                raise StartupError("interrupted during start-up")
            ready = sum(len(g.infos) for g in self.gens.generations.values())
            self.service.starting(self.clock(), ready, workers, deadline)
            next_supervise = self._turn(next_supervise, max_wait_s=0.2)
            if failures:
                break
        if failures:
            e = failures[0].error
            if e.step == "validate":
                raise ConfigError(e.message.split("; "))
            raise StartupError(e.message if len(self.startup_models) == 1 else f"{failures[0].rec.alias}: {e.message}")
        self._load_startup_adapters()
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
        self.views = Views(self.gens, self.frontend, self.liveness, started_at=self.started_at,
                           loop_counters=self.counters,
                           metric_families=lambda now: self.observe.families(self.views, now),
                           heap_trim=self.heap_trim)
        if cfg.board.handoff_endpoint or cfg.kv.disk_dir:  # KV transfer between boards (handoff/transfer.py)
            from engine.daemon.handoff.transfer import Transfers

            try:
                self.transfers = Transfers(self.ctx, self._poller, cfg, self.gens, self._submit_parked, self.security)
            except (zmq.ZMQError, ValueError) as e:
                raise StartupError(f"board.handoff_endpoint {cfg.board.handoff_endpoint}: {e}") from None
        self._ops = ops.OpContext(self.frontend, self.gens, self.views, self.apply, self.set_accepting,
                                  self.transfers)
        if cfg.metrics.port:
            log("metrics_serving", url=f"http://{cfg.metrics.host}:{self.observe.metrics.port}/metrics")
        log("serving", board=cfg.board.id, endpoints=list(cfg.server.endpoints), backend=cfg.board.backend,
            chips=cfg.board.chips, model=self.gens.model_alias, models=sorted(self.gens.models.published),
            pids=[lk.pid for g in self.gens.generations.values() for lk in g.links])
        self.service.ready(self.clock())

    def _load_startup_adapters(self) -> None:
        """The [[lora.adapter]] tables and --lora flags, through the adapter gate; a refused one fails start-up."""
        from engine.daemon.lora_registry import AdapterRefused

        for a in self.cfg.lora.adapter:
            try:
                self.gens.lora.load(a.name, a.path, a.base)
            except AdapterRefused as e:
                raise StartupError(f"lora adapter {a.name!r} ({a.path}): {e}") from None

    def wake(self) -> None:
        """Make the loop turn again at once (from any thread: a byte on the self-pipe)."""
        self._signals.wake()

    # -- poller registration ----------------------------------------------------------------
    def _register_link(self, g: Generation, chip: int) -> None:
        socks = g.links[chip].pollables()  # a chip's socket and fd; every rank's of a TP replica
        assert None not in socks
        for s in socks:  # a restarted link has a new socket and a new fd
            self._link_socks[s] = (g, chip)
            self._poller.register(s, zmq.POLLIN)

    def _unregister_link(self, g: Generation, chip: int) -> None:
        for s, (gg, c) in list(self._link_socks.items()):
            if gg is g and c == chip:
                self._poller.unregister(s)
                del self._link_socks[s]

    def _install_signals(self) -> None:
        handlers = {sig: self._on_signal for sig in STOP_SIGNALS + self.service.extra_signals()}
        handlers[signal.SIGCHLD] = self._on_child_exit
        self._poller.register(self._signals.install(handlers), zmq.POLLIN)

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
        g = self.gens.default_generation()
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
        front_socks, link_socks, gens = self._front_socks, self._link_socks, self.gens
        now = self.clock()
        until = next_supervise
        for g in gens.serving_generations():
            wake = g.scheduler.next_wakeup(now)
            if wake is not None and wake < until:
                until = wake
        ping = service.wake_by()
        if ping is not None and ping < until:
            until = ping
        tr = self.transfers
        if tr is not None:
            wake = tr.next_wakeup(now)
            if wake is not None and wake < until:
                until = wake
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
                    fe.handle_guarded(ops.handle, self._ops, conn, msg, now)
            elif sock == self._signals.read_fd:
                self._signals.drain()
            elif tr is not None and tr.owns(sock):
                tr.on_readable(sock, now)
        if tr is not None:
            tr.pump(now)
        if fe is not None:
            service.turn(now)
        for job in list(gens.load_jobs):
            job.poll(now)
        gens.lora.tick()
        if self._child_exited:
            self._child_exited = False
            next_supervise = now
        if now >= next_supervise:
            for g in gens.serving_generations():
                if g.rec.state in (ModelState.UNLOADING, ModelState.RECOVERING):
                    continue  # no restarts: it is going away (its job timeout ends a hung job)
                acts = g.supervise(now)
                n_actions += len(acts)
                self.apply(acts, g, now)
            if gens.generations and all(g.all_out() for g in gens.serving_generations()) \
                    and gens.serving_generations():
                log("fatal", reason="every chip is out of service")
                self.exit_code = EXIT_UNRECOVERABLE
            gens.drains(now)
            released = self.heap_trim.maybe_trim(now)
            if released is not None and released >= 1 << 20:
                log("malloc_trim", released_bytes=released, trims=self.heap_trim.trims,
                    trim_ms=round(self.heap_trim.last_trim_ms, 3), collect_ms=round(self.heap_trim.last_collect_ms, 3))
            # Heartbeat silence and start-up timeouts. A worker's exit does not wait for this: its SIGCHLD
            # wakes the loop. Every idle wake-up takes CPU from a CPU backend's compute threads.
            next_supervise = now + self.cfg.recovery.supervise_interval_ms / 1000.0
        elif gens.drains_due(now):
            gens.drains(now)
        if fe is not None:
            self.observe.publish(self.views, now)  # at most every PUBLISH_INTERVAL_S: busy turns keep it fresh
        blocked = None
        for g in gens.serving_generations():
            g.retry_backlog()
            acts = g.scheduler.tick(now)
            n_actions += len(acts)
            self.apply(acts, g, now)
            blocked = blocked or g.scheduler.admission_blocked
            if g.scheduler.notices:  # a ping/pong downgrade (inflight_governor.py), a chip hung on a job timeout
                for event, chip, reason in g.scheduler.take_notices():
                    if event == "chip_hung":
                        self.apply(g.chip_hung(chip, reason, now), g, now)
                        continue
                    assert event == "inflight_downgraded", event
                    log("inflight_downgraded", chip=chip, reason=reason, model=g.alias, generation=g.id)
        if self.kv_events is not None:
            self.kv_events.follow(gens.default_generation())
            self.kv_events.flush()
        if fe is not None:
            dead = fe.flush()
            if dead:
                self._cancel_dead(dead, now)
        trace = self.observe.trace if self.observe is not None else None
        if trace is not None:
            trace.turn(now, self.clock(), len(events), n_actions, blocked)
        return next_supervise

    # -- carrying out the cores' actions ---------------------------------------------------
    def apply(self, actions: list, g: Generation, now: float | None = None) -> None:
        """Carry out the actions generation `g`'s scheduler returned."""
        if not actions:
            return
        gens = self.gens
        internal = gens.internal
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
                    gens.ended(rid, t is FinishRequest)
                continue
            if t is EmitTokens:
                fe.emit(rid, a.tokens, a.logprobs, a.text, a.top_logprobs, a.prompt_logprobs)
            elif t is FinishRequest:
                fe.finish(rid, a.finish_reason, a.usage, a.timing)
                gens.ended(rid, True)
                if gens.lora.by_rid:
                    gens.lora.finished(rid, a.usage)
            elif t is FailRequest:
                fe.fail(rid, a.code, a.reason, a.message, a.retryable, a.retry_after_ms)
                if gens.lora.by_rid:
                    gens.lora.finished(rid, None)
                if a.timing is None and gens.generation_of(rid) is not None:
                    g.rec.counters["rejected"] += 1
                gens.ended(rid, False)
            else:
                raise AssertionError(f"unknown action {a!r}")

    def _submit_parked(self, rid: int, g: Generation, params, now: float) -> None:
        """A decode leg whose KV pull ended (imported or not): to its scheduler now."""
        if g.scheduler is None or g.id not in self.gens.generations:
            self.frontend.fail(rid, 503, "model_unavailable", "the model went away during the KV transfer", True,
                               clamp_ms(NOT_READY_RETRY_S))
            return
        self.gens.admit(rid, g)
        self.apply(g.scheduler.submit(rid, params, now), g, now)

    def _cancel_dead(self, rids: list[int], now: float) -> None:
        """Requests of clients that vanished or stopped reading: free their lanes."""
        self.counters["cancelled_dead_clients"] += len(rids)
        for rid in rids:
            if self.transfers is not None:
                self.transfers.client.cancel(rid, now)
            g = self.gens.generation_of(rid)
            if g is not None and g.scheduler is not None:
                self.apply(g.scheduler.cancel(rid, now), g, now)  # their events go nowhere
        self.frontend.flush()

    # -- admission and the service's questions ---------------------------------------------
    def set_accepting(self, accepting: bool) -> None:
        reopen_at = None
        if self.service.drain.state is not DrainState.SERVING:
            accepting = False  # an admin `resume` cannot undo a SIGTERM drain
            reopen_at = self.service.drain.deadline
        self.gens.set_accepting(accepting, reopen_at)

    def active_requests(self) -> int:
        return self.frontend.active()

    # -- shutdown ------------------------------------------------------------------
    def _shutdown(self) -> int:
        """Every live request gets its terminal event, then workers and shm go away."""
        now = self.clock()
        reason = "signal" if self._stop_signal is not None else "fatal"
        log("stopping", reason=reason, signal=self._stop_signal, active_requests=self.frontend.active())
        self.service.stopping(reason)
        self.gens.accepting = False
        if not self._core_broken:
            try:
                for job in list(self.gens.load_jobs):
                    job.abort(now, "the daemon is shutting down")
                for g in self.gens.serving_generations():
                    g.scheduler.set_accepting(False, "shutdown")
                    self.apply(g.scheduler.shutdown(now), g, now)
            except Exception as e:
                log("fatal", reason="shutdown of the core failed", error=repr(e))
                self.exit_code = self.exit_code or EXIT_INTERNAL
        # Whatever the core managed, no accepted request may end without its terminal event.
        self.frontend.fail_all(503 if self.exit_code == 0 else 500, "shutdown" if self.exit_code == 0 else "internal",
                               "the daemon is shutting down",
                               clamp_ms(NOT_READY_RETRY_S) if self.exit_code == 0 else None)
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
        self.gens.close()
        if self._signals.installed:
            try:
                self._poller.unregister(self._signals.read_fd)
            except KeyError:
                pass
            self._signals.close()
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
        if self.transfers is not None:
            self.transfers.close()
            self.transfers = None
        if self.ctx is not None:
            for ep in self.cfg.server.endpoints:
                if ep.startswith("ipc://"):
                    _remove_stale_socket(ep[len("ipc://"):])
            self.ctx.term()
            self.ctx = None


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
