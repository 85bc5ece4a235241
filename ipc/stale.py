"""Finding and removing shared-memory objects whose owner process is dead.

POSIX shared memory outlives its creator: a SIGKILLed daemon or worker leaves
its segments and semaphores in /dev/shm until someone unlinks them. The owner
pid is part of every name (`ipc.naming`), so a starting daemon can remove
exactly the objects of dead owners and nothing that a live process still uses.
"""

from __future__ import annotations

import os

import posix_ipc
import psutil

from ipc.naming import has_prefix, parse_owner_pid

SHM_DIR = "/dev/shm"
_SEM_PREFIX = "sem."
# psutil's process start time has clock-tick granularity; allow generous slack
# so that a live owner that created a segment in its first instants is never
# mistaken for a recycled pid.
_PID_REUSE_SLACK_S = 2.0


def _entries() -> list[str]:
    try:
        return sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return []


def list_segments(prefix: str) -> list[str]:
    """POSIX names ("/...") of the shared-memory segments made with `prefix`."""
    return ["/" + e for e in _entries() if not e.startswith(_SEM_PREFIX) and has_prefix(e, prefix)]


def list_semaphores(prefix: str) -> list[str]:
    """POSIX names ("/...") of the named semaphores made with `prefix`."""
    return [
        "/" + e[len(_SEM_PREFIX):]
        for e in _entries()
        if e.startswith(_SEM_PREFIX) and has_prefix(e[len(_SEM_PREFIX):], prefix)
    ]


def owner_is_dead(pid: int, entry_path: str | None = None) -> bool:
    """True when no process `pid` runs, or the one that does started after the
    object at `entry_path` was last changed (so it is a recycled pid)."""
    try:
        proc = psutil.Process(pid)
        started = proc.create_time()
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False
    if entry_path is None:
        return False
    try:
        st = os.stat(entry_path)
    except FileNotFoundError:
        return False
    return started > min(st.st_mtime, st.st_ctime) + _PID_REUSE_SLACK_S


def reap_stale(prefix: str) -> list[str]:
    """Unlink the segments and semaphores of `prefix` whose owner is dead.

    Returns the POSIX names removed (segments and semaphores alike; the random
    part keeps them distinct). Objects another process removes concurrently
    are skipped silently.
    """
    removed: list[str] = []
    for name in list_segments(prefix):
        pid = parse_owner_pid(name)
        if pid is None or not owner_is_dead(pid, SHM_DIR + name):
            continue
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            continue
        removed.append(name)
    for name in list_semaphores(prefix):
        pid = parse_owner_pid(name)
        if pid is None or not owner_is_dead(pid, f"{SHM_DIR}/{_SEM_PREFIX}{name[1:]}"):
            continue
        try:
            posix_ipc.unlink_semaphore(name)
        except posix_ipc.ExistentialError:
            continue
        removed.append(name)
    return removed
