"""Opt-in heap snapshots of a serving process, for finding what a long run keeps (a debugging aid, off by default).

With `NPUSERVE_TRACEMALLOC=DIR` in its environment, a board daemon and each
chip worker (which inherits the daemon's environment) start `tracemalloc`
at start-up and, on every SIGUSR2, write to DIR:

* `ROLE-PID-SEQ.tracemalloc`: the `tracemalloc` snapshot (`Snapshot.load`);
* `ROLE-PID-SEQ.json`: what the Python heap cannot show: the traced total,
  the process's anonymous RSS, and glibc's `mallinfo2` (native heap in use
  and free), so native growth (llama.cpp, numpy buffers, fragmentation) is
  told apart from Python objects kept alive.

With `NPUSERVE_TRACEMALLOC_TRIM=1` each dump also calls `malloc_trim(0)`
after measuring and records the anonymous RSS after it: memory the
allocator holds free but has not given back shows up as the difference.

`npuserve heap-diff` compares two dumps (top-N growth by line), and
`npuserve soak --tracemalloc DIR` takes one per progress line and prints
the diff over the run. Lives in `workers` because both the worker and the
daemon install it (the daemon may import `workers`, not the reverse).
Tracing slows allocation down and costs memory: never on in production.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import signal
import time
import tracemalloc

ENV = "NPUSERVE_TRACEMALLOC"  # the directory snapshots are written to; unset = off
FRAMES_ENV = "NPUSERVE_TRACEMALLOC_FRAMES"  # frames kept per allocation (default 8)
TRIM_ENV = "NPUSERVE_TRACEMALLOC_TRIM"  # "1": malloc_trim(0) after each dump, and the RSS it leaves
DEFAULT_FRAMES = 8
SIGNAL = signal.SIGUSR2
SNAPSHOT_SUFFIX = ".tracemalloc"

_state: dict = {}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def mallinfo() -> dict | None:
    """glibc's native heap: `arena` (main heap bytes) + `hblkhd` (mmapped blocks), in use (`uordblks`) and
    free but kept (`fordblks`); None without glibc's mallinfo2."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = _Mallinfo2
    m = fn()
    return {name: int(getattr(m, name)) for name, _ in _Mallinfo2._fields_}


def anon_rss() -> int:
    """This process's anonymous resident memory in bytes (RssAnon of /proc/self/status), 0 if unknown."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def install(role: str) -> bool:
    """Start tracing and take a dump on every SIGUSR2 when $NPUSERVE_TRACEMALLOC names a directory.

    Returns whether it did. Call from the main thread before the process serves. A bad value of the
    frames variable falls back to the default: a debugging aid must not stop a board from starting.
    """
    out = os.environ.get(ENV)
    if not out:
        return False
    try:
        frames = max(1, min(int(os.environ.get(FRAMES_ENV, DEFAULT_FRAMES)), 100))
    except ValueError:
        frames = DEFAULT_FRAMES
    os.makedirs(out, exist_ok=True)
    _state.update(dir=out, role=role, seq=0, trim=os.environ.get(TRIM_ENV) == "1")
    if not tracemalloc.is_tracing():
        tracemalloc.start(frames)
    signal.signal(SIGNAL, _on_signal)
    return True


def _on_signal(signum, frame) -> None:
    try:
        dump()
    except Exception as exc:  # noqa: BLE001 - a failed dump must not take the process down
        import sys

        print(f"heap snapshot failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def dump() -> str | None:
    """Write the next snapshot and its facts; returns the snapshot's path (None when not installed)."""
    if not _state or not tracemalloc.is_tracing():
        return None
    _state["seq"] += 1
    base = os.path.join(_state["dir"], f"{_state['role']}-{os.getpid()}-{_state['seq']:04d}")
    snap = tracemalloc.take_snapshot()
    traced, peak = tracemalloc.get_traced_memory()
    facts = {"role": _state["role"], "pid": os.getpid(), "seq": _state["seq"], "time": time.time(),
             "traced_bytes": traced, "traced_peak_bytes": peak, "anon_rss": anon_rss(), "mallinfo2": mallinfo()}
    if _state["trim"]:
        libc = _libc()
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
            facts["anon_rss_after_trim"] = anon_rss()
            facts["mallinfo2_after_trim"] = mallinfo()
    snap.dump(base + SNAPSHOT_SUFFIX + ".tmp")
    os.replace(base + SNAPSHOT_SUFFIX + ".tmp", base + SNAPSHOT_SUFFIX)
    with open(base + ".json.tmp", "w") as fh:
        json.dump(facts, fh)
    os.replace(base + ".json.tmp", base + ".json")
    return base + SNAPSHOT_SUFFIX
