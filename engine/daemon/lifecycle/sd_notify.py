"""The systemd notify protocol, spoken directly (no libsystemd binding needed).

systemd passes `NOTIFY_SOCKET` to a `Type=notify` service: a unix datagram
socket, a filesystem path or an abstract name written with a leading `@`.
Each message is one datagram of newline-separated `KEY=VALUE` lines
(`READY=1`, `STATUS=...`, `WATCHDOG=1`, ...; see sd_notify(3)). Without
`NOTIFY_SOCKET` every send is a no-op, so the same daemon runs at a terminal.

`WATCHDOG_USEC` (and `WATCHDOG_PID`, which must be ours) says how often
systemd wants `WATCHDOG=1`; a `Pacer` decides when the next one is due,
as a pure function of `now`, so that the *scheduler loop* sends it: a loop
that stops turning stops the pings and systemd restarts the service.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, MutableMapping

_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def socket_address(value: str) -> str | bytes:
    """The `connect` address of a NOTIFY_SOCKET value: `@name` is the abstract name `\\0name`."""
    if not value or not (value.startswith("/") or value.startswith("@")):
        raise ValueError(f"NOTIFY_SOCKET must be an absolute path or an @abstract name, got {value!r}")
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


def watchdog_interval_s(env: Mapping[str, str], pid: int) -> float | None:
    """systemd's watchdog period in seconds, or None when it is off or meant for another process."""
    usec = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if owner and (not owner.isdigit() or int(owner) != pid):
        return None
    return int(usec) / 1e6


def message(*lines: str, **fields: object) -> bytes:
    """One datagram: the given `KEY=VALUE` lines, then `fields` as KEY=value (no newline inside)."""
    out = list(lines) + [f"{k}={v}" for k, v in fields.items()]
    for ln in out:
        assert "\n" not in ln, f"a notify line cannot hold a newline: {ln!r}"
    return "\n".join(out).encode()


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds: what `RELOADING=1` carries as MONOTONIC_USEC (systemd >= 253)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends notify datagrams to systemd; a no-op without NOTIFY_SOCKET.

    Reads (and by default removes) the protocol's variables from the
    environment so that worker processes do not inherit them. A send never
    raises: systemd going away must not take the daemon with it.
    """

    def __init__(self, env: MutableMapping[str, str] | None = None, *, pid: int | None = None,
                 unset_environment: bool = True) -> None:
        env = os.environ if env is None else env
        pid = os.getpid() if pid is None else pid
        self.address: str | bytes | None = None
        value = env.get("NOTIFY_SOCKET", "")
        self.error: str | None = None
        if value:
            try:
                self.address = socket_address(value)
            except ValueError as e:
                self.error = str(e)
        self.watchdog_s = watchdog_interval_s(env, pid)
        if unset_environment:
            for k in _ENV_KEYS:
                env.pop(k, None)
        self._sock: socket.socket | None = None
        self.sent = 0
        self.failed = 0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str, **fields: object) -> bool:
        """Send one datagram; False when notify is off or the send failed."""
        if self.address is None:
            return False
        data = message(*lines, **fields)
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(data, self.address)
        except OSError:
            self.failed += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Pacer:
    """A periodic deadline as a pure function of `now`: due at the first call, then every `period_s`."""

    def __init__(self, period_s: float | None) -> None:
        assert period_s is None or period_s > 0
        self.period_s = period_s
        self._next: float | None = None

    def due(self, now: float) -> bool:
        """True (and the next one scheduled) when the periodic thing should happen at `now`."""
        if self.period_s is None:
            return False
        if self._next is None or now >= self._next:
            self._next = now + self.period_s
            return True
        return False

    def next_at(self) -> float | None:
        """When the caller must be awake next to stay on time (None: off, or never started)."""
        return self._next


def watchdog_pacer(watchdog_s: float | None) -> Pacer:
    """`WATCHDOG=1` every half of systemd's watchdog period, as sd_watchdog_enabled(3) advises."""
    return Pacer(None if watchdog_s is None else watchdog_s / 2)
