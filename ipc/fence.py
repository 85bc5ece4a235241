"""A memory fence usable from Python, for the shared-memory ring's counters.

Why this exists: the ring publishes a record by storing a counter after the
payload is written, and the peer must never observe the counter before the
payload. Python has no atomics API, so the reasoning is:

* Each Python-level store (numpy setitem, np.copyto, memoryview slice
  assignment) is a separate C call executed in program order, so the C
  compiler cannot move one across another.
* A counter is stored through a numpy uint64 view at an 8-byte aligned
  offset: numpy does one aligned 8-byte store, which is single-copy atomic on
  every 64-bit CPU, so a peer never reads a half-written counter.
* On x86-64 (TSO) stores become visible in program order and loads are not
  reordered with older loads, which is all the ring needs. On weakly ordered
  CPUs (ARM, POWER) the hardware may reorder them, so `fence()` is placed
  between the payload and the counter store (writer) and between the counter
  load and the payload reads (reader). It acquires and releases a private
  lock: CPython implements locks with a pthread mutex or semaphore, whose
  atomic read-modify-write instructions order all earlier accesses before
  all later ones in practice (that is what makes a mutex a mutex). It costs
  well under a microsecond, so it is issued on every architecture.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()


def fence() -> None:
    """Order every memory access before this call before every access after it."""
    _lock.acquire()
    _lock.release()
