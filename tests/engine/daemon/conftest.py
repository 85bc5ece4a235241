"""The daemon tests' own fixture: a NOTIFY_SOCKET listener standing in for systemd."""

from __future__ import annotations

import os
import time

import pytest

from daemon_procs import START_TIMEOUT_S


class NotifyListener:
    """A test-owned NOTIFY_SOCKET (plain path or abstract name) recording every datagram with its arrival time."""

    def __init__(self, short_dir: str, abstract: bool = False) -> None:
        import socket
        import threading

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"npuserve-test-notify-{os.getpid()}-{id(self)}"
            self.sock.bind(b"\0" + name.encode())
            self.address = "@" + name
        else:
            self.address = os.path.join(short_dir, "notify.sock")
            self.sock.bind(self.address)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import socket

        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
            with self._lock:
                self.messages.append((time.monotonic(), fields))

    def snapshot(self) -> list[tuple[float, dict[str, str]]]:
        with self._lock:
            return list(self.messages)

    def times(self, key: str, value: str | None = None) -> list[float]:
        return [t for t, m in self.snapshot() if key in m and (value is None or m[key] == value)]

    def wait_for(self, key: str, value: str | None = None, timeout: float = START_TIMEOUT_S,
                 after: float = 0.0) -> dict[str, str]:
        """The first message after `after` carrying `key` (= `value`), waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, m in self.snapshot():
                if t >= after and key in m and (value is None or m[key] == value):
                    return m
            time.sleep(0.02)
        raise AssertionError(f"no {key}={value} on the notify socket within {timeout} s: {self.snapshot()}")

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def notify_listener(short_dir):
    """Factory: `notify_listener(abstract=False)` -> NotifyListener, closed on teardown."""
    made: list[NotifyListener] = []

    def make(abstract: bool = False) -> NotifyListener:
        n = NotifyListener(short_dir, abstract)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()
