"""Signals into a poll loop: handlers that only record, and a self-pipe the poller watches.

A zmq.Poller is not interrupted by a Python signal handler, so `signal.set_wakeup_fd` turns each signal
into a byte on a pipe the poller already polls; the same pipe lets another thread wake the loop. The
board daemon's loop and the balancer's shell both run their signals through one of these.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


class SignalPipe:
    def __init__(self) -> None:
        self.read_fd = -1  # register it with the poller; `drain()` it when it is readable
        self._write_fd = -1
        self._old_handlers: dict[int, object] = {}
        self._old_wakeup_fd: int | None = None

    @property
    def installed(self) -> bool:
        return self.read_fd >= 0

    def install(self, handlers: dict[int, Callable]) -> int:
        """Install `handlers` (signal → handler) behind the wake-up pipe; returns the fd to poll."""
        assert not self.installed
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self.read_fd, self._write_fd = r, w
        self._old_wakeup_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for sig, handler in handlers.items():
            self._old_handlers[sig] = signal.signal(sig, handler)
        return r

    def wake(self) -> None:
        """Make the poller return at once (from any thread)."""
        if self._write_fd >= 0:
            try:
                os.write(self._write_fd, b"\0")
            except OSError:
                pass

    def drain(self) -> None:
        """Empty the pipe (the signals themselves were recorded by their handlers)."""
        try:
            while os.read(self.read_fd, 512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Put back the handlers and the wake-up fd that were there before, and close the pipe."""
        if not self.installed:
            return
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        signal.set_wakeup_fd(self._old_wakeup_fd if self._old_wakeup_fd is not None else -1)
        os.close(self.read_fd)
        os.close(self._write_fd)
        self.read_fd = self._write_fd = -1
