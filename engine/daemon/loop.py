"""The daemon's single-threaded event loop: sockets in, core actions out.

Everything that changes state happens here, on one thread (DESIGN §2): the
zmq.Poller waits on the client ROUTER sockets, one control socket and one
result doorbell fd per chip and a self-pipe that signals write to; each
wake-up feeds what arrived into the sans-I/O scheduler core, calls `tick`,
and carries out the actions it returns. The poll timeout is the core's
`next_wakeup` bounded by the supervision period, so an idle daemon sleeps.
"""

from __future__ import annotations

import inspect
import math
import os
import signal
import time
import traceback
from collections import deque
from typing import Callable

import zmq

from engine.config import Config, validate_against_model
from engine.core.actions import EmitTokens, FailRequest, FinishRequest, SubmitJob
from engine.core.scheduler import ChipSpec, ConfigurationError, ModelSpec, Scheduler
from engine.core.scheduler_config import scheduler_config_from
from engine.daemon import ops
from engine.daemon.drain import DrainState
from engine.daemon.frontend import Frontend
from engine.daemon.liveness import LoopLiveness
from engine.daemon.load_report import load_report
from engine.daemon.log import log
from engine.daemon.sd_notify import Notifier
from engine.daemon.service import STOP_SIGNALS, Service
from engine.daemon.observe import MetricsPortBusy, Observers
from engine.daemon.supervisor import ChipState, Decision, Supervisor
from engine.daemon.text_io import piece_function, served_tokenizer
from ipc.records import Job
from ipc.ring import RingFull
from ipc.shm import ShmFull
from ipc.stale import reap_stale
from workers.backends.base import BackendInfo
from workers.chip_link import SHM_PREFIX, ChipLink, Heartbeat, Ready, Result, WorkerFailed

SUPERVISE_INTERVAL_S = 0.1  # how often worker liveness is checked (death is seen within this)
STARTUP_TIMEOUT_S = 120.0  # first READY of a worker (the ref model may be built on first run)
RESTART_TIMEOUT_S = 30.0  # READY of a restarted worker
EXIT_UNRECOVERABLE = 3  # every chip out of service
EXIT_INTERNAL = 4  # a bug: the core's state can no longer be trusted


class StartupError(RuntimeError):
    """The daemon cannot start serving (worker start-up failure, model/config mismatch)."""


def backend_options(cfg: Config, chip: int) -> dict:
    """The config keys a backend's constructor understands (block size, KV blocks, chip id)."""
    from workers.backends.registry import backend_class

    wanted = {"block_size": cfg.kv.block_size, "chip_id": chip}
    if cfg.kv.num_blocks:
        wanted["num_blocks"] = cfg.kv.num_blocks
    if cfg.board.backend == "ctypes" and cfg.model.ctypes_library:
        wanted["library"] = cfg.model.ctypes_library
    if cfg.board.backend == "llamacpp":
        wanted.update(chips=cfg.board.chips, threads=cfg.board.threads_per_chip)
    params = inspect.signature(backend_class(cfg.board.backend).__init__).parameters
    return {k: v for k, v in wanted.items() if k in params}


class Daemon:
    """One board: workers, scheduler core, frontend. `start()`, then `run()` until a signal."""

    def __init__(self, cfg: Config, *, package_path: str | None = None,
                 extra_backend_options: dict | None = None, clock: Callable[[], float] = time.monotonic,
                 notifier: Notifier | None = None, config_loader: Callable[[], Config] | None = None,
                 trace_path: str | None = None) -> None:
        self.cfg = cfg
        self.trace_path = trace_path
        self.observe: Observers | None = None  # metrics and trace (engine/daemon/observe.py)
        self.package_path = package_path
        self.extra_backend_options = dict(extra_backend_options or {})
        self.clock = clock
        self.model_alias = cfg.model.alias
        self.ctx: zmq.Context | None = None
        self.links: list[ChipLink] = []
        self.frontend: Frontend | None = None
        self.security = None  # engine.daemon.curve.CurveSetup when security.server_secret_key is set
        self.kv_events = None  # engine.daemon.kv_events.KvEventPublisher when kv_events.endpoint is set
        self.scheduler: Scheduler | None = None
        self.supervisor: Supervisor | None = None
        self.liveness = LoopLiveness(cfg.server.loop_stall_ms / 1000.0)
        self.info: BackendInfo | None = None
        self.tokenizer = None  # the served model's tokenizer (workers.tokenizer), None when it has none
        self.accepting = True
        self.started_at = clock()
        self.exit_code = 0
        self._core_broken = False
        self._next_rid = 0
        self._stop_signal: int | None = None
        self._serving = False  # from run(): stop signals drain instead of stopping at once
        self.service = Service(self, notifier, config_loader)  # systemd notify, drain, reload
        self._backlog: list[deque[Job]] = []
        self._device_us = [0] * cfg.board.chips  # time the backend calls took, per chip
        self._worker_us = [0] * cfg.board.chips  # job read -> result written in the worker, per chip
        self._poller = zmq.Poller()
        self._link_socks: dict[zmq.Socket | int, int] = {}  # each link's socket and result doorbell fd
        self._front_socks: dict[zmq.Socket, int] = {}
        self._sig_r = self._sig_w = -1
        self._old_handlers: dict[int, object] = {}
        self._old_wakeup_fd: int | None = None
        self.counters = {"jobs_submitted": 0, "ring_full": 0, "results": 0, "chip_failures": 0,
                         "worker_restarts": 0, "cancelled_dead_clients": 0}

    # -- start-up -------------------------------------------------------------
    def start(self) -> None:
        """Spawn the workers, wait for them, build the core, bind the frontend. Raises StartupError."""
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
        hb = cfg.recovery.heartbeat_interval_ms / 1000.0
        for chip in range(cfg.board.chips):
            opts = backend_options(cfg, chip)
            opts.update(self.extra_backend_options)
            link = ChipLink(ctx=self.ctx, board=cfg.board.id, chip=chip, backend=cfg.board.backend,
                            backend_options=opts, package_path=self.package_path,
                            runtime_dir=cfg.board.runtime_dir, heartbeat_interval_s=hb)
            self.links.append(link)
            self._backlog.append(deque())
            try:
                link.start()
            except ShmFull as e:
                raise StartupError(f"chip {chip}: {e.strerror}") from None
        infos = self._wait_ready(STARTUP_TIMEOUT_S)
        self.info = info = infos[0]
        for chip, other in enumerate(infos):
            if (other.vocab_size, other.max_seq, other.profiles, other.eos_ids) != \
                    (info.vocab_size, info.max_seq, info.profiles, info.eos_ids):
                raise StartupError(f"chip {chip} loaded a different model than chip 0")
        profiles = [p.batch for p in info.profiles]
        validate_against_model(cfg, profiles, info.max_seq)  # ConfigError propagates
        model = ModelSpec(generation=1, vocab_size=info.vocab_size, eos_ids=tuple(info.eos_ids),
                          max_seq=info.max_seq, profiles=tuple(profiles), chunked_prefill=info.chunked_prefill)
        chips = [ChipSpec(chip=c, num_blocks=i.kv.num_blocks, block_size=i.kv.block_size)
                 for c, i in enumerate(infos)]
        try:
            self.tokenizer = served_tokenizer(self.package_path, info)
        except Exception as e:  # noqa: BLE001 - any failure to load it is a start-up failure worth naming
            raise StartupError(f"cannot load the model's tokenizer: {e}") from None
        piece = None if self.tokenizer is None else piece_function(self.tokenizer)
        try:
            self.scheduler = Scheduler(scheduler_config_from(cfg), model, chips, piece=piece)
        except ConfigurationError as e:
            raise StartupError(f"configuration does not fit the model: {e}") from None
        now = self.clock()
        self.supervisor = Supervisor(cfg.board.chips, max_resets_per_10min=cfg.recovery.max_resets_per_10min,
                                     heartbeat_timeout_s=cfg.recovery.heartbeat_timeout_ms / 1000.0,
                                     startup_timeout_s=RESTART_TIMEOUT_S, now=now)
        for chip in range(cfg.board.chips):
            self.supervisor.on_ready(chip, now)
            self._register_link(chip)
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
            chips=cfg.board.chips, model=self.model_alias, pids=[lk.pid for lk in self.links])
        self.service.ready(self.clock())

    def _wait_ready(self, timeout_s: float) -> list[BackendInfo]:
        poller = zmq.Poller()
        for lk in self.links:
            poller.register(lk.socket, zmq.POLLIN)
        infos: dict[int, BackendInfo] = {}
        deadline = time.monotonic() + timeout_s
        while len(infos) < len(self.links):
            if self._stop_signal is not None:
                raise StartupError("interrupted during start-up")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [c for c in range(len(self.links)) if c not in infos]
                raise StartupError(f"workers of chips {missing} not ready within {timeout_s:.0f} s")
            self.service.starting(time.monotonic(), len(infos), len(self.links), deadline)
            poller.poll(min(left, 0.2) * 1000)
            for chip, lk in enumerate(self.links):
                for ev in lk.handle_events():
                    if isinstance(ev, Ready):
                        infos[chip] = ev.info
                    elif isinstance(ev, WorkerFailed):
                        raise StartupError(f"chip {chip} worker failed to start: {ev.message}")
        return [infos[c] for c in range(len(self.links))]

    def _register_link(self, chip: int) -> None:
        lk = self.links[chip]
        assert lk.socket is not None and lk.result_fd is not None
        for s in (lk.socket, lk.result_fd):  # a restarted link has a new socket and a new fd
            self._link_socks[s] = chip
            self._poller.register(s, zmq.POLLIN)

    def _unregister_link(self, chip: int) -> None:
        for s, c in list(self._link_socks.items()):
            if c == chip:
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
        self._poller.register(r, zmq.POLLIN)

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
        caches = prefix_caches(self.scheduler)
        try:
            self.kv_events = KvEventPublisher(self.ctx, ep, self.cfg.kv_events.topic, caches)
        except zmq.ZMQError as e:
            raise StartupError(f"cannot publish KV events on {ep}: {e}; set kv_events.endpoint to a free "
                               "address (or \"\" to turn them off)") from None
        log("kv_events_publishing", endpoint=ep, block_size=sorted({c.block_size for c in caches.values()}))

    # -- the loop ------------------------------------------------------------------
    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (exit 0) or an unrecoverable failure (non-zero)."""
        assert self.scheduler is not None and self.frontend is not None
        self._serving = True
        try:
            self._serve(self.clock())
        except Exception as e:  # a core or shell bug: the state can no longer be trusted
            log("fatal", reason="internal error", error=repr(e), traceback=traceback.format_exc())
            self.exit_code = EXIT_INTERNAL
            self._core_broken = True
        return self._shutdown()

    def _serve(self, next_supervise: float) -> None:
        sched, fe, live = self.scheduler, self.frontend, self.liveness
        front_socks, link_socks, service = self._front_socks, self._link_socks, self.service
        obs = self.observe
        trace = obs.trace
        while self._stop_signal is None and self.exit_code == 0:
            now = self.clock()
            wake = sched.next_wakeup(now)
            until = next_supervise if wake is None else min(wake, next_supervise)
            ping = service.wake_by()
            if ping is not None and ping < until:
                until = ping
            timeout_ms = max(0, math.ceil((until - now) * 1000))
            live.sleeping(now)
            events = self._poller.poll(timeout_ms)
            now = self.clock()
            live.woke(now)
            actions: list = []
            for sock, _ in events:
                if sock in link_socks:
                    actions += self._on_link(link_socks[sock], now)
                elif sock in front_socks:
                    for conn, msg in fe.receive(front_socks[sock]):
                        actions += fe.handle_guarded(ops.handle, self, conn, msg, now)
                elif sock == self._sig_r:
                    _drain_fd(self._sig_r)
            service.turn(now)
            if now >= next_supervise:
                actions += self._supervise(now)
                next_supervise = now + SUPERVISE_INTERVAL_S
                obs.publish(self, now)
            self._retry_backlog()
            actions += sched.tick(now)
            self._apply(actions, now)
            if self.kv_events is not None:
                self.kv_events.flush()
            dead = fe.flush()
            if dead:
                self._cancel_dead(dead, now)
            if trace is not None:
                trace.turn(now, self.clock(), len(events), len(actions), sched.admission_blocked)

    def _on_link(self, chip: int, now: float) -> list:
        sched, sup = self.scheduler, self.supervisor
        out: list = []
        for ev in self.links[chip].handle_events():
            t = type(ev)
            if t is Result:
                self.counters["results"] += 1
                self.observe.on_result(chip, ev.result, now)
                self._device_us[chip] += ev.result.device_us
                self._worker_us[chip] += ev.result.worker_us
                out += sched.on_result(chip, ev.result, now)
            elif t is Heartbeat:
                pass  # ChipLink.last_heartbeat is what supervision reads
            elif t is Ready:
                if sup.state(chip) in (ChipState.STARTING, ChipState.RESTARTING):
                    sup.on_ready(chip, now)
                    log("chip_up", chip=chip, pid=ev.pid)
                    out += sched.on_chip_up(chip, now)
            elif t is WorkerFailed:
                if sup.state(chip) is not ChipState.OUT:
                    out += self._chip_failed(chip, f"worker failed: {ev.message}", now)
        return out

    def _apply(self, actions: list, now: float | None = None) -> None:
        if actions and self.observe is not None:
            self.observe.on_actions(actions, self.clock() if now is None else now)
        fe = self.frontend
        for a in actions:
            t = type(a)
            if t is EmitTokens:
                fe.emit(a.request_id, a.tokens, a.logprobs, a.text)
            elif t is SubmitJob:
                self._submit(a.chip, a.job)
            elif t is FinishRequest:
                fe.finish(a.request_id, a.finish_reason, a.usage, a.timing)
            elif t is FailRequest:
                fe.fail(a.request_id, a.code, a.reason, a.message, a.retryable)
            else:
                raise AssertionError(f"unknown action {a!r}")

    def _submit(self, chip: int, job: Job) -> None:
        backlog = self._backlog[chip]
        if self.supervisor.state(chip) is not ChipState.UP:
            return  # the core will see the chip-down / time the job out; nothing to run it on
        if backlog:
            backlog.append(job)
            return
        try:
            self.links[chip].submit(job)
            self.counters["jobs_submitted"] += 1
        except RingFull:
            self.counters["ring_full"] += 1
            backlog.append(job)

    def _retry_backlog(self) -> None:
        for chip, backlog in enumerate(self._backlog):
            while backlog:
                try:
                    self.links[chip].submit(backlog[0])
                except RingFull:
                    break
                backlog.popleft()
                self.counters["jobs_submitted"] += 1

    def _cancel_dead(self, rids: list[int], now: float) -> None:
        """Requests of clients that vanished or stopped reading: free their lanes."""
        self.counters["cancelled_dead_clients"] += len(rids)
        actions: list = []
        for rid in rids:
            actions += self.scheduler.cancel(rid, now)
        self._apply(actions, now)  # their events go nowhere: the frontend forgot them
        self.frontend.flush()

    # -- supervision -----------------------------------------------------------------
    def _supervise(self, now: float) -> list:
        sup = self.supervisor
        out: list = []
        for chip, lk in enumerate(self.links):
            if sup.state(chip) is ChipState.OUT:
                continue
            reason = sup.check(chip, alive=lk.is_alive(), last_heartbeat=lk.last_heartbeat, now=now)
            if reason is not None:
                out += self._chip_failed(chip, reason, now)
        return out

    def _chip_failed(self, chip: int, reason: str, now: float) -> list:
        sup = self.supervisor
        was_up = sup.state(chip) is ChipState.UP
        self.counters["chip_failures"] += 1
        out = self.scheduler.on_chip_down(chip, now) if was_up else []
        self.observe.on_chip_down(chip, now)
        self._backlog[chip].clear()
        decision = sup.on_failure(chip, reason, now)
        lk = self.links[chip]
        self._unregister_link(chip)
        lk.kill()
        if decision is Decision.RESTART:
            log("chip_down", chip=chip, reason=reason, action="restart")
            try:
                lk.restart()
            except Exception as e:  # e.g. no room for new rings: this chip cannot come back
                log("restart_failed", chip=chip, error=repr(e))
                sup.take_out(chip, f"restart failed: {e}", now)
                decision = Decision.TAKE_OUT
            else:
                self.counters["worker_restarts"] += 1
                self._register_link(chip)
        if decision is Decision.TAKE_OUT:
            log("chip_down", chip=chip, reason=reason, action="out_of_service",
                max_resets_per_10min=sup.max_resets)
            try:
                lk.stop()
            except Exception as e:
                log("stop_failed", chip=chip, error=repr(e))
            if sup.all_out():
                log("fatal", reason="every chip is out of service")
                self.exit_code = EXIT_UNRECOVERABLE
        return out

    # -- replies ---------------------------------------------------------------------
    def next_request_id(self) -> int:
        self._next_rid += 1
        return self._next_rid

    def set_accepting(self, accepting: bool) -> None:
        if self.service.drain.state is not DrainState.SERVING:
            accepting = False  # an admin `resume` cannot undo a SIGTERM drain
        self.accepting = accepting
        self.scheduler.set_accepting(accepting, "draining")

    def model_info(self) -> dict:
        i = self.info
        return {"alias": self.model_alias, "backend": self.cfg.board.backend, "generation": 1,
                "vocab_size": i.vocab_size, "max_seq": i.max_seq, "eos_ids": list(i.eos_ids),
                "profiles": [p.batch for p in i.profiles], "sha256": i.model_sha256,
                "text": self.tokenizer is not None}

    def chips_info(self, now: float) -> list[dict]:
        snap = self.supervisor.snapshot(now)
        for s, lk in zip(snap, self.links):
            s["pid"] = lk.pid
            s["backlog"] = len(self._backlog[s["chip"]])
            s["device_s"] = round(self._device_us[s["chip"]] / 1e6, 3)
            s["worker_s"] = round(self._worker_us[s["chip"]] / 1e6, 3)
        return snap

    def health(self, now: float) -> dict:
        up = self.supervisor.in_service()
        loop_ok = self.liveness.healthy(now)
        return {
            "ok": bool(up) and loop_ok and self.accepting,
            "accepting": self.accepting,
            "loop_ok": loop_ok,
            "loop_lag_ms": round(self.liveness.lag_s(now) * 1000, 3),
            "chips_up": len(up),
            "chips": self.chips_info(now),
            "model": self.model_info(),
            "board": self.cfg.board.id,
            "pid": os.getpid(),
            "uptime_s": round(now - self.started_at, 3),
            "active_requests": self.frontend.active(),
            "load": load_report(self.scheduler.stats()),
        }

    def stats(self, now: float) -> dict:
        return {
            "scheduler": self.scheduler.stats(now),
            "metrics": self.observe.families(self, now),
            "frontend": self.frontend.counters.as_dict(),
            "daemon": dict(self.counters, active_requests=self.frontend.active(),
                           loop_turns=self.liveness.turns,
                           loop_max_turn_ms=round(self.liveness.max_turn_s * 1000, 3)),
            "chips": self.chips_info(now),
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
                self.scheduler.set_accepting(False, "shutdown")
                self._apply(self.scheduler.shutdown(now), now)
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
        for chip, lk in enumerate(self.links):
            self._unregister_link(chip)
            try:
                lk.stop()
            except Exception as e:  # keep cleaning the other chips
                log("stop_failed", chip=chip, error=repr(e))
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
