"""Names of POSIX shared-memory objects (segments and semaphores).

A name is "/{prefix}-{board}-{ownerpid}-{tag}{random hex}". The owner pid in
the name is what lets a restarting daemon find and remove what a dead owner
left behind (`ipc.stale`); the random part keeps two objects of one owner
apart. Prefix and board may not contain "-" so that the pid is always the
third field, whatever the tag holds.
"""

from __future__ import annotations

import os
import re
import secrets

_FIELD = re.compile(r"^[A-Za-z0-9_.]+$")
_TAG = re.compile(r"^[A-Za-z0-9_.]*$")
# Linux keeps NAME_MAX = 255 for the /dev/shm entry, and semaphores get "sem." prepended.
MAX_NAME_LEN = 240


def make_name(prefix: str, board: str | int, tag: str = "", pid: int | None = None) -> str:
    """Return a fresh object name owned by `pid` (default: this process)."""
    board = str(board)
    if not _FIELD.match(prefix):
        raise ValueError(f"prefix {prefix!r} must be non-empty [A-Za-z0-9_.]")
    if not _FIELD.match(board):
        raise ValueError(f"board {board!r} must be non-empty [A-Za-z0-9_.]")
    if not _TAG.match(tag):
        raise ValueError(f"tag {tag!r} may only hold [A-Za-z0-9_.]")
    owner = os.getpid() if pid is None else pid
    name = f"/{prefix}-{board}-{owner}-{tag}{secrets.token_hex(4)}"
    if len(name) > MAX_NAME_LEN:
        raise ValueError(f"name too long ({len(name)} > {MAX_NAME_LEN}): {name!r}")
    return name


def parse_owner_pid(name: str) -> int | None:
    """The owner pid encoded in `name`, or None when `name` is not one of ours.

    Accepts the POSIX name ("/p-b-pid-x"), the bare /dev/shm entry ("p-b-pid-x")
    and the semaphore entry ("sem.p-b-pid-x").
    """
    base = name.rsplit("/", 1)[-1]
    if base.startswith("sem."):
        base = base[4:]
    parts = base.split("-", 3)
    if len(parts) != 4 or not _FIELD.match(parts[0]) or not _FIELD.match(parts[1]):
        return None
    if not parts[2].isdigit() or not parts[2].isascii():
        return None
    pid = int(parts[2])
    return pid if pid > 0 else None


def has_prefix(name: str, prefix: str) -> bool:
    """True when the POSIX name `name` was made with `prefix`."""
    return name.lstrip("/").startswith(prefix + "-")
