"""A chip worker frozen with jobs in its ring, then killed: the daemon's recovery of in-flight jobs under test."""

from __future__ import annotations

import contextlib
import os
import signal

from waiting import wait_until


@contextlib.contextmanager
def frozen_then_killed(client, pid: int, chip: int = 0):
    """The worker `pid` of `chip` stopped (SIGSTOP: it takes jobs into its ring but answers none) while the block
    starts requests; leaving the block waits until a job has reached the chip, then kills the worker, so those
    jobs are in flight when it dies."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
        wait_until(lambda: client.stats()["scheduler"]["chips"][str(chip)]["inflight"] != 0, timeout=60.0,
                   interval=0.02, what=f"a job reaching chip {chip}")
    finally:
        os.kill(pid, signal.SIGKILL)  # a stopped process dies of it too; by the next line it may be reaped
