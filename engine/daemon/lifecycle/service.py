"""The daemon as a system service: systemd notify and watchdog, drain on SIGTERM, reload on SIGHUP.

The shell around `drain.Drain` and `config_reload`: signal handlers only queue
the signal number (the self-pipe wakes the loop), and the loop calls `turn()`
once per wake-up, so every decision here runs on the loop thread, in order
with the requests. `WATCHDOG=1` is sent from that turn, never from a thread
of its own: a loop that stops turning stops the pings.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from engine.config import Config, ConfigError
from engine.config_reload import config_changes, reloaded
from engine.core.model_state import ModelState
from engine.core.scheduler_config import scheduler_config_from
from engine.daemon import log as daemon_log
from engine.daemon.lifecycle.drain import Drain, DrainState, SignalOutcome
from engine.daemon.lifecycle.liveness import LoopLiveness
from engine.daemon.log import log
from engine.daemon.lifecycle.sd_notify import Notifier, Pacer, monotonic_usec, watchdog_pacer

if TYPE_CHECKING:
    from engine.daemon.generations import Generations

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXTEND_EVERY_S = 5.0  # EXTEND_TIMEOUT_USEC is repeated this often while a long load or drain runs
STOP_GRACE_S = 15.0  # after the drain: flush (1 s linger) and worker stop (up to ~6 s per chip, in parallel)
STATUS_EVERY_S = 1.0  # STATUS= is refreshed at most this often (and only when it changed)
TEST_HOOKS_ENV = "NPUSERVE_TEST_HOOKS"  # "1": SIGUSR1 stalls the loop (watchdog tests)
TEST_STALL_ENV = "NPUSERVE_TEST_STALL_S"  # how long a SIGUSR1 stall lasts (default 3 s)


class Host(Protocol):
    """What the service asks of the loop that runs it."""

    def active_requests(self) -> int: ...

    def request_stop(self, signum: int | None) -> None: ...


class Service:
    def __init__(self, host: Host, gens: "Generations", liveness: LoopLiveness, notifier: Notifier | None = None,
                 config_loader: Callable[[], Config] | None = None) -> None:
        """`gens`: the generations registry, whose `cfg` a reload replaces and whose admission a drain ends."""
        self.host, self.gens, self.liveness = host, gens, liveness
        self.notify = Notifier() if notifier is None else notifier
        if self.notify.error:
            log("notify_socket_invalid", error=self.notify.error)
        self.watchdog = watchdog_pacer(self.notify.watchdog_s)
        self.extend = Pacer(EXTEND_EVERY_S)
        self.status = Pacer(STATUS_EVERY_S)
        self.drain = Drain()
        self.config_loader = config_loader
        self.pending: list[int] = []  # signal numbers, appended by handlers, handled by `turn`
        self.test_hooks = os.environ.get(TEST_HOOKS_ENV) == "1"
        self.stall_s = float(os.environ.get(TEST_STALL_ENV, "3"))
        self._status_text = ""
        self._stopping_sent = False
        self._stop_signal: int = signal.SIGTERM  # the signal that started the drain
        self.counters = {"watchdog_pings": 0, "reloads": 0, "reload_failures": 0}

    def extra_signals(self) -> tuple[int, ...]:
        """Signals the daemon handles besides the stop signals: SIGHUP, and SIGUSR1 under test hooks."""
        return (signal.SIGHUP, signal.SIGUSR1) if self.test_hooks else (signal.SIGHUP,)

    # -- start-up ----------------------------------------------------------------------
    def starting(self, now: float, ready: int, total: int, deadline: float) -> None:
        """While the workers load: keep systemd's start timeout ahead of our own start-up deadline."""
        if self.extend.due(now):
            self.notify.send(f"EXTEND_TIMEOUT_USEC={_usec(max(0.0, deadline - now) + STOP_GRACE_S)}",
                             f"STATUS=starting: loading the model on {total} chip workers ({ready}/{total} ready)")

    def ready(self, now: float) -> None:
        """Workers warm and endpoints bound: READY=1 (systemd now starts dependent units)."""
        self.extend = Pacer(EXTEND_EVERY_S)
        if self.notify.watchdog_s is not None:
            log("watchdog_enabled", watchdog_s=self.notify.watchdog_s, ping_every_s=self.watchdog.period_s)
        self._status_text = self._serving_status()
        self.notify.send("READY=1", f"STATUS={self._status_text}", f"MAINPID={os.getpid()}")
        self.watchdog.due(now)  # READY counts as the first sign of life; the next ping is half a period away
        self.status.due(now)

    # -- the loop's turn -----------------------------------------------------------------
    def turn(self, now: float) -> None:
        """Once per loop wake-up: signals, drain progress, watchdog, status."""
        while self.pending:
            self._on_signal(self.pending.pop(0), now)
        if self.drain.draining:
            cause = self.drain.check(now, self.host.active_requests())
            if cause is not None:
                log("drain_ended", cause=cause.value, active_requests=self.host.active_requests(),
                    drain_s=round(now - (self.drain.started_at or now), 3))
                self.host.request_stop(self._stop_signal)
            elif self.extend.due(now):
                left = self.drain.remaining_s(now)
                log("drain_progress", active_requests=self.host.active_requests(), remaining_s=round(left, 1))
                self.notify.send(f"EXTEND_TIMEOUT_USEC={_usec(left + STOP_GRACE_S)}")
        if self.watchdog.due(now):
            self.counters["watchdog_pings"] += 1
            self.notify.send("WATCHDOG=1")
        if self.status.due(now) and self.drain.state is not DrainState.STOPPING:
            text = self._draining_status(now) if self.drain.draining else self._serving_status()
            if text != self._status_text:
                self._status_text = text
                self.notify.send(f"STATUS={text}")

    def wake_by(self) -> float | None:
        """The latest time the loop may sleep until (the next watchdog ping)."""
        return self.watchdog.next_at()

    def stopping(self, reason: str) -> None:
        """The loop has ended: STOPPING=1 (unless the drain already said so) and a last STATUS."""
        if self.drain.cause is not None:
            reason = f"drain ended ({self.drain.cause.value})"
        lines = [f"STATUS=stopping: {reason}"]
        if not self._stopping_sent:
            self._stopping_sent = True
            lines.insert(0, "STOPPING=1")
        self.notify.send(*lines)

    def close(self) -> None:
        self.notify.close()

    # -- signals ---------------------------------------------------------------------------
    def _on_signal(self, signum: int, now: float) -> None:
        if signum in STOP_SIGNALS:
            budget = self.gens.cfg.server.drain_timeout_s
            outcome = self.drain.on_stop_signal(now, budget)
            if outcome is SignalOutcome.BEGIN_DRAIN:
                self._stop_signal = signum
                self.gens.set_accepting(False, self.drain.deadline)  # 503 draining, as the admin `drain` op answers
                active = self.host.active_requests()
                log("drain_started", signal=signal.Signals(signum).name, active_requests=active,
                    drain_timeout_s=budget, note="a second SIGTERM/SIGINT stops at once")
                self.extend = Pacer(EXTEND_EVERY_S)
                self.extend.due(now)
                self._status_text = self._draining_status(now)
                self._stopping_sent = True
                self.notify.send("STOPPING=1", f"EXTEND_TIMEOUT_USEC={_usec(budget + STOP_GRACE_S)}",
                                 f"STATUS={self._status_text}")
            elif outcome is SignalOutcome.STOP_NOW:
                log("drain_ended", cause="second_signal", signal=signal.Signals(signum).name,
                    active_requests=self.host.active_requests(),
                    drain_s=round(now - (self.drain.started_at or now), 3))
                self.host.request_stop(signum)
        elif signum == signal.SIGHUP:
            self.reload(now)
        elif signum == signal.SIGUSR1 and self.test_hooks:
            log("test_hook_stall", seconds=self.stall_s)
            time.sleep(self.stall_s)  # on purpose: the loop stops turning, so the watchdog pings stop

    # -- reload ----------------------------------------------------------------------------------
    def reload(self, now: float) -> None:
        """SIGHUP: re-read the config, apply the reloadable keys, report the rest as needing a restart."""
        self.notify.send("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}", "STATUS=reloading the configuration")
        log("reload_started")
        old = self.gens.cfg
        try:
            if self.config_loader is None:
                raise ConfigError("this daemon was started without a way to re-read its configuration")
            new = self.config_loader()
            changes = config_changes(old, new)
            running = reloaded(old, new)
            sched_cfg = scheduler_config_from(running)
        except (ConfigError, ValueError) as e:
            self.counters["reload_failures"] += 1
            errors = e.errors if isinstance(e, ConfigError) else [str(e)]
            log("reload_failed", errors=errors, note="still running on the previous configuration")
        else:
            for g in self.gens.serving_generations():
                if g.rec.state is not ModelState.WARMING:  # a loading one takes it when it is published
                    g.scheduler.reconfigure(sched_cfg)
            self.liveness.stall_threshold_s = running.server.loop_stall_ms / 1000.0
            daemon_log.configure(running.log.level, running.log.format)
            self.gens.cfg = running
            self.counters["reloads"] += 1
            for c in changes:
                if not c.reloadable:
                    log("reload_needs_restart", key=c.key, running=c.as_dict()["old"], configured=c.as_dict()["new"])
            log("config_reloaded", changed=[c.as_dict() for c in changes if c.reloadable],
                needs_restart=[c.key for c in changes if not c.reloadable])
        self._status_text = self._draining_status(now) if self.drain.draining else self._serving_status()
        self.notify.send("READY=1", f"STATUS={self._status_text}")

    # -- status text -------------------------------------------------------------------------------
    def _serving_status(self) -> str:
        gens = self.gens
        g = gens.default_generation()
        up = len(g.supervisor.in_service()) if g is not None and g.supervisor is not None else 0
        admit = "serving" if gens.accepting else "not admitting (drained by an admin)"
        return (f"{admit} model {gens.model_alias!r} on {', '.join(gens.cfg.server.endpoints)}: "
                f"{up}/{gens.cfg.board.replicas} {'replicas' if gens.cfg.board.chips_per_replica > 1 else 'chips'} "
                f"up, {self.host.active_requests()} requests in flight")

    def _draining_status(self, now: float) -> str:
        return (f"draining: {self.host.active_requests()} requests in flight, "
                f"{self.drain.remaining_s(now):.0f} s left of the {self.gens.cfg.server.drain_timeout_s:g} s budget")


def _usec(seconds: float) -> int:
    return int(seconds * 1e6)
