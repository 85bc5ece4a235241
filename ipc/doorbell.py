"""Doorbells: how a ring reader learns that a record is ready without spinning.

The writer commits a record and then rings; the reader waits. A waiting
reader spins for a short, configurable time (cheap wake-up when records come
back to back) and then parks in the kernel, so an idle reader costs nothing.

No wake-up is lost as long as the reader follows the pattern

    while True:
        rec = ring.peek()
        if rec is None:
            bell.wait(timeout)      # parks; True when rung
            continue
        ...; ring.release()

because a ring always follows the commit, and the reader always checks the
ring after `wait()` returns: a ring that happens between the reader's empty
peek and its wait leaves the semaphore posted (or a message queued), so the
wait returns at once. `wait()` drains all pending rings in one go, so a burst
of N records costs the reader one wake-up, not N.

Two implementations behind one Protocol:

* SemaphoreDoorbell: a POSIX named semaphore; ring = sem_post (a userspace
  atomic unless the reader is parked), the cheapest hot-path wake-up. With
  `adaptive=True` the reader spins only while spinning pays (see below).

Adaptive spin: a spin is CPU spent on the bet that a ring comes within
`spin_s`. When the writer's turnaround is longer than that, or the cores are
all busy (the writer waits for a core, so its ring comes late), nearly every
spin is lost and the spinning reader holds a core its writer needed. So an
adaptive doorbell times each wait that found no ring pending, spun or parked
alike, and keeps a moving share of the waits that a ring ended within
`spin_s` (a parked wait counts its wake-up latency too: on a busy host that
makes a spin look as bad as it is). It spins while that share is at least
SPIN_PAYS, and parks at once otherwise; since parked waits are timed as well,
spinning comes back when rings come back quickly. Measured on 2 cores, 64
stub streams (docs/results/2026-12-02-host-cost.md): 98.5 % of the fixed 200
us spins ran out.

Why not skip the ring when the reader is awake (an "eventcount" flag in
shared memory)? sem_post already is that: glibc's post is one atomic add
and enters the kernel only when a waiter is registered (a ring with the
reader spinning costs ~0.3 us in Python, most of it the call); a parked
reader has to be woken either way.
* ZmqDoorbell: a ZeroMQ PAIR socket over ipc://; slower, but its socket can
  sit in a zmq.Poller next to the control sockets of an event loop. Caveat:
  a bound socket cannot queue a ring before its peer's (asynchronous) connect
  completes; ring() waits up to `connect_grace_s` for it and then drops the
  ring, so readers should wait with a finite re-check timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from types import TracebackType
from typing import Protocol, runtime_checkable

import posix_ipc
import zmq

from ipc.naming import make_name, parse_owner_pid

DEFAULT_SPIN_S = 50e-6
# A ZeroMQ wake-up is carried by the I/O threads of both contexts; spinning the
# reader's core only delays them (measured on 2 cores: 64 B handoff 67 µs
# without spin, 123 µs with 50 µs of spin), so the zmq doorbell parks at once.
DEFAULT_ZMQ_SPIN_S = 0.0
SEM_MODE = 0o600
# Keep the semaphore far from SEM_VALUE_MAX if nobody ever waits on it.
_MAX_PENDING = 1 << 20
# Adaptive spin: spin while at least this share of recent waits ended within spin_s ...
SPIN_PAYS = 0.5
# ... the share being a moving average over about this many waits.
_SPIN_WINDOW = 16
# Rings queue up to this many messages; a full queue means a wake-up is pending anyway.
_ZMQ_HWM = 1024
DEFAULT_CONNECT_GRACE_S = 0.1


@runtime_checkable
class Doorbell(Protocol):
    def ring(self) -> None: ...

    def wait(self, timeout: float | None) -> bool: ...

    def close(self) -> None: ...


def _spin_until(check: Callable[[], bool], spin_s: float) -> bool:
    if spin_s <= 0:
        return False
    end = time.perf_counter() + spin_s
    while True:
        if check():
            return True
        if time.perf_counter() >= end:
            return False


class SemaphoreDoorbell:
    """A POSIX named semaphore used as a doorbell (mode 0600, pid-carrying name)."""

    name: str
    owner_pid: int
    created: bool

    def __init__(self, sem: posix_ipc.Semaphore, created: bool, spin_s: float, adaptive: bool = False) -> None:
        self._sem: posix_ipc.Semaphore | None = sem
        self.name = sem.name
        pid = parse_owner_pid(sem.name)
        self.owner_pid = -1 if pid is None else pid
        self.created = created
        self.spin_s = spin_s
        self.adaptive = adaptive
        self.quick_share = 1.0  # adaptive: moving share of waits a ring ended within spin_s (start by spinning)
        self._unlinked = False

    @classmethod
    def create(cls, prefix: str, board: str | int, tag: str = "", *, spin_s: float = DEFAULT_SPIN_S,
               adaptive: bool = False) -> "SemaphoreDoorbell":
        name = make_name(prefix, board, tag)
        # The umask can only remove bits from 0600, never add any.
        sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=SEM_MODE, initial_value=0)
        return cls(sem, created=True, spin_s=spin_s, adaptive=adaptive)

    @classmethod
    def attach(cls, name: str, *, spin_s: float = DEFAULT_SPIN_S, adaptive: bool = False) -> "SemaphoreDoorbell":
        return cls(posix_ipc.Semaphore(name), created=False, spin_s=spin_s, adaptive=adaptive)

    @property
    def spinning(self) -> bool:
        """Whether the next wait that finds no ring pending spins first."""
        return self.spin_s > 0 and (not self.adaptive or self.quick_share >= SPIN_PAYS)

    def _learn(self, quick: bool) -> None:
        self.quick_share += ((1.0 if quick else 0.0) - self.quick_share) / _SPIN_WINDOW

    @property
    def _s(self) -> posix_ipc.Semaphore:
        if self._sem is None:
            raise ValueError(f"doorbell {self.name} is closed")
        return self._sem

    def ring(self) -> None:
        sem = self._s
        if sem.value < _MAX_PENDING:
            sem.release()

    def _try(self) -> bool:
        try:
            self._s.acquire(0)
        except posix_ipc.BusyError:
            return False
        return True

    def _drain(self) -> None:
        while self._try():
            pass

    def wait(self, timeout: float | None) -> bool:
        """Spin for `spin_s` (adaptive: only while spinning pays), then park until rung or `timeout`
        seconds pass (None: for ever)."""
        if self._try():
            self._drain()
            return True
        adaptive = self.adaptive
        spin = self.spin_s if self.spinning else 0.0
        t0 = time.perf_counter() if adaptive else 0.0
        if spin and _spin_until(self._try, spin):
            if adaptive:
                self._learn(True)
            self._drain()
            return True
        if timeout is not None:
            timeout -= spin
            if timeout <= 0:
                if adaptive:
                    self._learn(False)
                return False
        try:
            self._s.acquire(timeout)
        except posix_ipc.BusyError:
            if adaptive:
                self._learn(False)
            return False
        except posix_ipc.SignalError:
            # EINTR: report "not rung" (callers re-check) so that the Python
            # signal handler runs on return, in the caller, not lost under a
            # SignalError (a worker's SIGTERM on its parent's death was).
            return False
        if adaptive:
            self._learn(time.perf_counter() - t0 <= self.spin_s)
        self._drain()
        return True

    def close(self) -> None:
        if self._sem is None:
            return
        self._sem.close()
        self._sem = None

    def unlink(self) -> None:
        if self._unlinked:
            return
        self._unlinked = True
        try:
            posix_ipc.unlink_semaphore(self.name)
        except posix_ipc.ExistentialError:
            pass

    def __enter__(self) -> "SemaphoreDoorbell":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.close()
        finally:
            if self.created:
                self.unlink()


class ZmqDoorbell:
    """A ZeroMQ PAIR socket over ipc:// used as a doorbell.

    create() binds the endpoint, attach() connects to it; either side may ring
    or wait. `socket` can be registered in a zmq.Poller (POLLIN = rung); call
    `wait(0)` after the poller fires to drain it.
    """

    endpoint: str

    def __init__(self, sock: zmq.Socket, endpoint: str, bound: bool, spin_s: float, own_ctx: zmq.Context | None) -> None:
        self._sock: zmq.Socket | None = sock
        self.connect_grace_s = DEFAULT_CONNECT_GRACE_S
        self.endpoint = endpoint
        self.bound = bound
        self.spin_s = spin_s
        self._own_ctx = own_ctx

    @classmethod
    def _open(cls, endpoint: str, bind: bool, context: zmq.Context | None, spin_s: float) -> "ZmqDoorbell":
        own = None
        if context is None:
            own = context = zmq.Context(io_threads=1)
        sock = context.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _ZMQ_HWM)
        sock.setsockopt(zmq.RCVHWM, _ZMQ_HWM)
        try:
            if bind:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except BaseException:
            sock.close(0)
            if own is not None:
                own.term()
            raise
        return cls(sock, endpoint, bind, spin_s, own)

    @classmethod
    def create(cls, endpoint: str, *, context: zmq.Context | None = None, spin_s: float = DEFAULT_ZMQ_SPIN_S) -> "ZmqDoorbell":
        return cls._open(endpoint, True, context, spin_s)

    @classmethod
    def attach(cls, endpoint: str, *, context: zmq.Context | None = None, spin_s: float = DEFAULT_ZMQ_SPIN_S) -> "ZmqDoorbell":
        return cls._open(endpoint, False, context, spin_s)

    @property
    def socket(self) -> zmq.Socket:
        if self._sock is None:
            raise ValueError(f"doorbell {self.endpoint} is closed")
        return self._sock

    def ring(self) -> None:
        """Queue one wake-up. A bound socket has nowhere to queue until its peer
        has connected (connect is asynchronous), so on EAGAIN wait up to
        `connect_grace_s` for the peer; after that the ring is dropped, which is
        safe when the queue is full (a wake-up is already pending) and bounded
        by the reader's re-check interval when no peer exists."""
        sock = self.socket
        try:
            sock.send(b"", zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        if sock.poll(int(self.connect_grace_s * 1000), zmq.POLLOUT):
            try:
                sock.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass

    def _drain(self) -> bool:
        sock = self.socket
        got = False
        while True:
            try:
                sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return got
            got = True

    def wait(self, timeout: float | None) -> bool:
        if self._drain() or _spin_until(self._drain, self.spin_s):
            return True
        if timeout is not None:
            timeout -= self.spin_s
            if timeout <= 0:
                return False
        ms = -1 if timeout is None else max(1, int(timeout * 1000 + 0.999))
        if not self.socket.poll(ms, zmq.POLLIN):
            return False
        self._drain()
        return True

    def close(self) -> None:
        sock = self._sock
        if sock is None:
            return
        self._sock = None
        sock.close(0)
        if self._own_ctx is not None:
            self._own_ctx.term()
            self._own_ctx = None
        if self.bound and self.endpoint.startswith("ipc://"):
            try:
                os.unlink(self.endpoint[len("ipc://"):])
            except FileNotFoundError:
                pass

    def __enter__(self) -> "ZmqDoorbell":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
