"""The balancer process: one zmq.Poller loop around the balancer core.

Client side: the daemon's own `Frontend` (ROUTER sockets, per-request
bookkeeping, coalescing, back-pressure, vanished-client detection), so a
client cannot tell a balancer from a daemon. Upstream: one `UpstreamLink`
(DEALER + monitor) per backend. Signals arrive through a self-pipe:
SIGTERM/SIGINT stop (every live request gets its terminal event), SIGHUP
re-reads the config file and replaces the backend list without touching
in-flight streams.
"""

from __future__ import annotations

import collections
import math
import os
import random
import signal
import time
import traceback
from dataclasses import replace
from typing import Callable

import orjson
import zmq

from engine.balancer import ops
from engine.balancer.actions import (CloseBackend, EmitTokens, FailRequest, FinishRequest, OpenBackend, Reply,
                                     ReplyError, SendUpstream)
from engine.balancer.core import BalancerCore
from engine.balancer.metrics import BalancerMetrics
from engine.balancer.settings import BalancerSettings
from engine.balancer.upstream import UpstreamLink
from engine.config import ConfigError
from engine.core.retry_after import NOT_READY_RETRY_S, clamp_ms
from engine.daemon.auth import visible_stats
from engine.daemon.frontend import Frontend
from engine.daemon.lifecycle.signal_pipe import SignalPipe
from engine.daemon.log import log
from engine.exit_codes import EXIT_INTERNAL
from ipc.codec import ProtocolError, decode_event
from ipc.schema import TOKEN_ID_MAX


class Balancer:
    def __init__(self, settings: BalancerSettings, *, reload: Callable[[], BalancerSettings] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.reload_settings = reload
        self.clock = clock
        self.ctx: zmq.Context | None = None
        self.frontend: Frontend | None = None
        self.core = BalancerCore(settings.core_config(), settings.backend_specs(), clock(), random.Random())
        self.links: dict[str, UpstreamLink] = {}
        self.security = None  # engine.daemon.curve.CurveSetup when CURVE is configured
        self._poller = zmq.Poller()
        self._front_socks: dict[zmq.Socket, int] = {}
        self._link_socks: dict[zmq.Socket, str] = {}
        self._mon_socks: dict[zmq.Socket, str] = {}
        self._next_rid = 0
        self._signal_pipe = SignalPipe()
        self._signals: list[int] = []
        self.exit_code = 0
        self._stop = False
        self.metrics = BalancerMetrics()

    def next_request_id(self) -> int:
        self._next_rid += 1
        return self._next_rid

    # -- start-up -------------------------------------------------------------------
    def start(self) -> None:
        self._install_signals()
        self.ctx = zmq.Context()
        sec = self.settings.security
        if sec.server_secret_key or sec.client_secret_key:
            from engine.daemon.curve import CurveSetup

            self.security = CurveSetup(self.ctx, server_secret_key=sec.server_secret_key,
                                       client_keys_dir=sec.client_keys_dir, admins=sec.admins,
                                       forwarders=sec.forwarders, client_secret_key=sec.client_secret_key)
        eps = list(self.settings.balancer.endpoints)
        for ep in eps:
            if ep.startswith("ipc://"):
                os.makedirs(os.path.dirname(ep[len("ipc://"):]), mode=0o700, exist_ok=True)
        self.frontend = Frontend(self.ctx, eps, max_message_bytes=self.settings.balancer.max_message_bytes,
                                 max_send_queue=self.settings.balancer.max_send_queue,
                                 secure=self.security)
        for i, s in enumerate(self.frontend.sockets):
            self._front_socks[s] = i
            self._poller.register(s, zmq.POLLIN)
            if eps[i].startswith("ipc://"):
                os.chmod(eps[i][len("ipc://"):], 0o600)
        self._apply(self.core.take_setup_actions(), self.clock())
        m = self.settings.metrics
        if m.port:
            try:
                self.metrics.serve(m.host, m.port)
            except OSError as e:
                raise ValueError(f"metrics port {m.host}:{m.port} cannot be bound: {e.strerror or e}; choose "
                                 f"another with --metrics-port or metrics.port (0 turns it off)") from None
            log("metrics_serving", url=f"http://{m.host}:{self.metrics.port}/metrics")
        log("balancing", endpoints=eps, backends=[b.endpoint for b in self.settings.backends],
            policy=self.settings.balancer.policy, curve=self.security is not None)

    def _install_signals(self) -> None:
        handlers = {sig: self._on_signal for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        self._poller.register(self._signal_pipe.install(handlers), zmq.POLLIN)

    def _on_signal(self, signum, frame) -> None:
        self._signals.append(signum)

    # -- backends ------------------------------------------------------------------------
    def _open_link(self, name: str) -> None:
        spec = next(b for b in self.settings.backends if b.endpoint == name)
        curve = None if self.security is None else self.security.client_keys_for(spec.server_key, name)
        link = UpstreamLink(self.ctx, name, name, curve)
        self.links[name] = link
        self._link_socks[link.sock] = name
        self._mon_socks[link.monitor] = name
        self._poller.register(link.sock, zmq.POLLIN)
        self._poller.register(link.monitor, zmq.POLLIN)

    def _close_link(self, name: str) -> None:
        link = self.links.pop(name, None)
        if link is None:
            return
        for s, d in ((link.sock, self._link_socks), (link.monitor, self._mon_socks)):
            self._poller.unregister(s)
            d.pop(s, None)
        link.close()

    def _reload(self, now: float) -> None:
        if self.reload_settings is None:
            log("reload_ignored", reason="no config file")
            return
        try:
            new = self.reload_settings()
            if self.security is not None:  # unreadable backend keys fail the reload, not the balancer
                for b in new.backends:
                    self.security.client_keys_for(b.server_key, b.endpoint)
        except ConfigError as e:
            log("reload_failed", errors=e.errors)
            return
        except ValueError as e:
            log("reload_failed", errors=[str(e)])
            return
        self.settings = _keep_listening_side(self.settings, new)
        actions = self.core.set_backends(new.backend_specs(), now)
        log("reloaded", backends=[b.endpoint for b in new.backends])
        self._apply(actions, now)

    # -- loop -------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self._serve()
        except Exception as e:
            log("fatal", reason="internal error", error=repr(e), traceback=traceback.format_exc())
            self.exit_code = EXIT_INTERNAL
        return self._shutdown()

    def _serve(self) -> None:
        core, fe = self.core, self.frontend
        while not self._stop:
            now = self.clock()
            wake = core.next_wakeup(now)
            timeout = 1000 if wake is None else max(0, math.ceil((wake - now) * 1000))
            events = self._poller.poll(min(timeout, 1000))
            now = self.clock()
            actions: list = []
            for sock, _ in events:
                name = self._link_socks.get(sock)
                if name is not None:
                    for data in self.links[name].recv_all():
                        ev = _tokens_fast(data)
                        if ev is None:
                            try:
                                ev = decode_event(data)
                            except ProtocolError as e:
                                log("bad_upstream_event", backend=name, error=str(e))
                                continue
                        actions += core.on_event(name, ev, now)
                    continue
                name = self._mon_socks.get(sock)
                if name is not None:
                    for event in self.links[name].monitor_events():
                        if event == zmq.EVENT_DISCONNECTED:
                            log("backend_disconnected", backend=name)
                            actions += core.on_disconnect(name, now)
                        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                            actions += core.on_connect(name, now)
                    continue
                idx = self._front_socks.get(sock)
                if idx is not None:
                    for conn, msg in fe.receive(idx):
                        actions += fe.handle_guarded(ops.handle, self, conn, msg, now)
                elif sock == self._signal_pipe.read_fd:
                    self._signal_pipe.drain()
                    self._on_signals(now)
            actions += core.tick(now)
            self._apply(actions, now)
            self.metrics.publish(core, now)
            dead = fe.flush()
            if dead:
                self._apply(core.client_gone(dead, now), now)

    def _on_signals(self, now: float) -> None:
        sigs, self._signals = self._signals, []
        for s in sigs:
            if s == signal.SIGHUP:
                self._reload(now)
            else:
                self._stop = True

    def _apply(self, actions: list, now: float) -> None:
        fe, core = self.frontend, self.core
        todo = collections.deque(actions)
        while todo:
            a = todo.popleft()
            t = type(a)
            if t is SendUpstream:
                link = self.links.get(a.backend)
                if link is None or not link.send(a.msg):
                    todo.extend(core.on_send_failed(a.backend, a.msg, now))
            elif t is EmitTokens:
                fe.emit(a.request_id, a.tokens, a.logprobs, a.text, a.top_logprobs, a.prompt_logprobs)
            elif t is FinishRequest:
                fe.finish(a.request_id, a.finish_reason, a.usage, a.timing)
            elif t is FailRequest:
                fe.fail(a.request_id, a.code, a.reason, a.message, a.retryable, a.retry_after_ms)
            elif t is Reply:
                conn, cid = a.token
                fe.reply(conn, cid, a.ev, visible_stats(conn, a.body) if a.ev == "stats" else a.body)
            elif t is ReplyError:
                conn, cid = a.token
                fe.error(conn, cid, a.code, a.reason, a.message, a.retryable)
            elif t is OpenBackend:
                self._open_link(a.backend)
            elif t is CloseBackend:
                self._close_link(a.backend)
            else:
                raise AssertionError(f"unknown action {a!r}")

    # -- shutdown -------------------------------------------------------------------------
    def _shutdown(self) -> int:
        now = self.clock()
        log("stopping", active_requests=self.core.active())
        try:
            self._apply(self.core.shutdown(now), now)
        except Exception as e:
            log("fatal", reason="shutdown failed", error=repr(e))
        if self.frontend is not None:
            self.frontend.fail_all(503, "shutdown", "the balancer is shutting down", clamp_ms(NOT_READY_RETRY_S))
            self.frontend.flush()
        self.close()
        log("stopped", exit_code=self.exit_code)
        return self.exit_code

    def close(self) -> None:
        self.metrics.close()
        for name in list(self.links):
            self._close_link(name)
        if self.frontend is not None:
            for s in list(self._front_socks):
                self._poller.unregister(s)
            self._front_socks.clear()
            self.frontend.close(linger_ms=1000)
            self.frontend = None
        if self.security is not None:
            self.security.stop()
            self.security = None
        self._signal_pipe.close()
        if self.ctx is not None:
            for ep in self.settings.balancer.endpoints:
                if ep.startswith("ipc://"):
                    try:
                        os.unlink(ep[len("ipc://"):])
                    except FileNotFoundError:
                        pass
            self.ctx.term()
            self.ctx = None


def _keep_listening_side(old: BalancerSettings, new: BalancerSettings) -> BalancerSettings:
    """A reload changes the backends (and their keys); the listening side stays as started."""
    return replace(new, balancer=old.balancer, security=old.security, metrics=old.metrics)


def _tokens_fast(data: bytes) -> dict | None:
    """A well-formed `tokens` event without logprobs, checked inline (one per token per stream: the hot path);
    None sends everything else through the full `decode_event` check."""
    try:
        ev = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if type(ev) is not dict or ev.get("ev") != "tokens" or ev.get("v") != 1 or "logprobs" in ev:
        return None
    toks = ev.get("tokens")
    if type(ev.get("id")) is not str or type(toks) is not list or not toks:
        return None
    for t in toks:
        if type(t) is not int or not 0 <= t <= TOKEN_ID_MAX:
            return None
    return ev
