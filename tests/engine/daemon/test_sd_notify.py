"""The notify protocol over real datagram sockets (plain path and abstract name), and its pacing."""

from __future__ import annotations

import os
import socket

import pytest

from engine.daemon.lifecycle.sd_notify import (Notifier, Pacer, message, socket_address, watchdog_interval_s,
                                                watchdog_pacer)


def _receiver(kind: str, short_dir: str) -> tuple[socket.socket, str]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if kind == "plain":
        path = os.path.join(short_dir, "notify")
        s.bind(path)
        return s, path
    name = f"npuserve-test-{os.getpid()}-{id(s)}"
    s.bind(b"\0" + name.encode())
    return s, "@" + name


@pytest.mark.parametrize("kind", ["plain", "abstract"])
def test_notifier_delivers_one_datagram_per_send(kind, short_dir):
    rx, value = _receiver(kind, short_dir)
    rx.settimeout(5)
    env = {"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "77", "OTHER": "x"}
    n = Notifier(env, pid=77)
    try:
        assert n.enabled and n.watchdog_s == 4.0
        assert env == {"OTHER": "x"}  # the protocol's variables are not inherited by the workers
        assert n.send("READY=1", STATUS="serving 2 chips")
        assert rx.recv(4096) == b"READY=1\nSTATUS=serving 2 chips"
        assert n.send("WATCHDOG=1")
        assert rx.recv(4096) == b"WATCHDOG=1"
        assert n.sent == 2
    finally:
        n.close()
        rx.close()


def test_without_notify_socket_sends_are_no_ops():
    n = Notifier({}, pid=1)
    assert not n.enabled and n.watchdog_s is None
    assert n.send("READY=1") is False


def test_a_vanished_socket_makes_send_fail_quietly(short_dir):
    n = Notifier({"NOTIFY_SOCKET": os.path.join(short_dir, "nobody")}, pid=1)
    assert n.send("READY=1") is False and n.failed == 1


def test_socket_address_forms():
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("@abc/def") == b"\0abc/def"
    for bad in ("", "relative/path", "vsock:2:1"):
        with pytest.raises(ValueError):
            socket_address(bad)
    n = Notifier({"NOTIFY_SOCKET": "relative"}, pid=1)
    assert not n.enabled and "absolute path" in n.error


def test_watchdog_interval_is_for_our_pid_only():
    assert watchdog_interval_s({"WATCHDOG_USEC": "2000000"}, 5) == 2.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "5"}, 5) == 2.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "6"}, 5) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}, 5) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "x"}, 5) is None
    assert watchdog_interval_s({}, 5) is None


def test_message_refuses_a_newline_inside_a_line():
    assert message("A=1", B=2) == b"A=1\nB=2"
    with pytest.raises(AssertionError):
        message("STATUS=two\nlines")


def test_watchdog_pings_every_half_period_of_a_fake_clock():
    p = watchdog_pacer(10.0)
    assert p.period_s == 5.0
    times = [t / 10 for t in range(0, 301)]  # 0 .. 30 s in 0.1 s steps
    pings = [t for t in times if p.due(t)]
    assert pings == [0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0]
    assert p.next_at() == 35.0


def test_a_loop_that_stops_turning_sends_no_ping_until_it_turns_again():
    p = watchdog_pacer(2.0)
    assert p.due(0.0)
    # the loop is stuck from t=0.2 to t=7: nobody calls due(); its next turn sends one ping, not a burst
    assert p.due(0.2) is False
    assert p.due(7.0) is True and p.due(7.1) is False and p.next_at() == 8.0


def test_pacer_off():
    p = Pacer(None)
    assert p.due(0.0) is False and p.next_at() is None
