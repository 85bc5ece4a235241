"""`npuserve top [ENDPOINT]`: the `stats` dashboard, refreshed live, with rates.

Plain ANSI (clear screen, redraw) when stdout is a terminal; a separator line
between frames otherwise, so `--iterations N` can be piped or tested. A daemon
that does not answer is said so on screen, with what to do, and asked again
at the next refresh; Ctrl-C leaves cleanly.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from engine.client import Client, default_endpoint
from engine.errors import ClientError, ClientTimeout
from tools.stats_view import render

CLEAR = "\x1b[H\x1b[2J"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve top", description="Watch a daemon's metrics live.")
    p.add_argument("endpoint", nargs="?", default=None,
                   help="daemon endpoint (default: $NPUSERVE_ENDPOINT, else the `make run` endpoint)")
    p.add_argument("--endpoint", dest="endpoint_opt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (default: until Ctrl-C)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each reply")
    a = p.parse_args(argv)
    if a.interval <= 0 or a.timeout <= 0 or a.iterations < 0:
        p.error("--interval and --timeout must be > 0, --iterations >= 0")
    return a


def down_message(endpoint: str, err: ClientError, timeout: float, interval: float) -> str:
    why = f"nothing within {timeout:g} s" if isinstance(err, ClientTimeout) else str(err)
    return (f"npuserve top: no answer from {endpoint} ({why}).\n"
            f"Is the daemon running? Start one with `npuserve serve`, or pass its endpoint: "
            f"`npuserve top ENDPOINT`.\nAsking again every {interval:g} s; Ctrl-C to quit.")


class CtrlC:
    """Ctrl-C ends `top` between frames: a KeyboardInterrupt raised inside the client's locks or its socket
    call could leave a lock held and hang the exit, so the signal only interrupts the sleep between frames
    and is otherwise noted and acted on once the frame in hand is written."""

    def __init__(self) -> None:
        self.asked = False
        self.sleeping = False

    def __call__(self, signum, frame) -> None:
        self.asked = True
        if self.sleeping:
            raise KeyboardInterrupt

    def sleep(self, seconds: float) -> None:
        self.sleeping = True
        try:
            if not self.asked:
                time.sleep(seconds)
        finally:
            self.sleeping = False


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    endpoint = a.endpoint or a.endpoint_opt or default_endpoint()
    tty = sys.stdout.isatty()
    previous: tuple[float, dict] | None = None
    ok = False
    n = 0
    ctrl_c = CtrlC()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, ctrl_c)
    try:
        with Client(endpoint, timeout=a.timeout) as c:
            while not ctrl_c.asked:
                n += 1
                try:
                    stats = c.stats()
                    now = time.monotonic()
                    frame = f"npuserve top · {endpoint} · every {a.interval:g} s · Ctrl-C to quit\n" \
                            + render(stats, previous, now)
                    previous, ok = (now, stats), True
                except ClientError as e:
                    frame, ok = down_message(endpoint, e, a.timeout, a.interval), False
                    previous = None
                sys.stdout.write((CLEAR if tty else ("" if n == 1 else "\n" + "-" * 40 + "\n")) + frame + "\n")
                sys.stdout.flush()
                if a.iterations and n >= a.iterations:
                    break
                ctrl_c.sleep(a.interval)
    except KeyboardInterrupt:
        pass
    if ctrl_c.asked:
        sys.stdout.write("\n")
        return 0
    return 0 if ok else 2
