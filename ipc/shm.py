"""POSIX shared-memory segments: create, attach, map, close, unlink.

Why a wrapper: every segment must be 0600, carry its owner's pid in its name
(so a restarting daemon can reap what a dead owner left, see `ipc.stale`) and
be unlinked on every exit path. Used as a context manager, a segment that this
process created is unlinked on exit; an attached one is only unmapped.
"""

from __future__ import annotations

import errno
import mmap
import os
import warnings
from types import TracebackType

import posix_ipc

from ipc.naming import make_name, parse_owner_pid
from ipc.stale import list_segments, list_semaphores, reap_stale

SHM_PREFIX = "npuserve"
SHM_MODE = 0o600

__all__ = [
    "SHM_PREFIX",
    "Segment",
    "ShmFull",
    "list_segments",
    "list_semaphores",
    "parse_owner_pid",
    "reap_stale",
]


class ShmFull(OSError):
    """/dev/shm has no room for a new segment (raised at creation, instead of SIGBUS on a later write)."""


def _reserve(fd: int, size: int, name: str) -> None:
    """Allocate the segment's pages now.

    A tmpfs segment is sparse: ftruncate succeeds whatever the free space, and
    the first write to a page that cannot be allocated kills the writer with
    SIGBUS -- a daemon started on a nearly full /dev/shm would die under load.
    Reserving at creation turns that into a clear error at start-up.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            free = _shm_free_bytes()
            raise ShmFull(e.errno, f"/dev/shm has no room for shared-memory segment {name} of {size} bytes "
                                   f"({free} bytes free): free space in /dev/shm (or enlarge it) and retry") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without fallocate: stay sparse
            raise


def _shm_free_bytes() -> int | str:
    try:
        st = os.statvfs("/dev/shm")
        return st.f_bavail * st.f_frsize
    except OSError:
        return "unknown"


class Segment:
    """One mapped POSIX shared-memory segment.

    `buf` is a writable memoryview of the whole mapping. close() unmaps;
    unlink() removes the name (the memory lives until every process unmaps).
    Both are idempotent.
    """

    name: str
    size: int
    buf: memoryview
    owner_pid: int
    created: bool

    def __init__(self, name: str, mm: mmap.mmap, size: int, created: bool) -> None:
        self.name = name
        self.size = size
        self._mmap: mmap.mmap | None = mm
        self.buf = memoryview(mm)
        pid = parse_owner_pid(name)
        self.owner_pid = -1 if pid is None else pid
        self.created = created
        self._unlinked = False

    @classmethod
    def create(cls, prefix: str, board: str | int, size: int, tag: str = "") -> "Segment":
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        name = make_name(prefix, board, tag)
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=SHM_MODE, size=size)
        try:
            # The umask can strip bits but never add them; enforce 0600 exactly.
            os.fchmod(shm.fd, SHM_MODE)
            _reserve(shm.fd, size, name)
            mm = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        shm.close_fd()
        return cls(name, mm, size, created=True)

    @classmethod
    def attach(cls, name: str, read_only: bool = False) -> "Segment":
        """Map an existing segment; `read_only` maps it PROT_READ (another board's host KV pool)."""
        shm = posix_ipc.SharedMemory(name, read_only=read_only)
        try:
            size = shm.size
            if size <= 0:
                raise ValueError(f"segment {name} is empty")
            mm = mmap.mmap(shm.fd, size, prot=mmap.PROT_READ) if read_only else mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        return cls(name, mm, size, created=False)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Unmap. If numpy views of the mapping are still alive the unmap is left
        to the garbage collector (mmap unmaps when its last exporter dies), so a
        stray view can never point at unmapped memory; a ResourceWarning says so."""
        mm = self._mmap
        if mm is None:
            return
        self._mmap = None
        try:
            self.buf.release()
        except BufferError:
            pass
        try:
            mm.close()
        except BufferError:
            warnings.warn(
                f"shm segment {self.name}: views still alive at close(); unmapping when they are freed",
                ResourceWarning,
                stacklevel=2,
            )

    def unlink(self) -> None:
        if self._unlinked:
            return
        self._unlinked = True
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass

    def __enter__(self) -> "Segment":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        finally:
            if self.created:
                self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Segment({self.name!r}, size={self.size}, {state})"
