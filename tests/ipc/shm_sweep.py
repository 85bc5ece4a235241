"""Removing the shared-memory objects a shm or doorbell test made, and failing the test that left any."""

from __future__ import annotations


def sweep_shm(prefix: str) -> None:
    """Unlink every segment and semaphore named with `prefix`, then fail if there was any.

    The teardown of the shm/doorbell tests' autouse fixtures: a test that
    leaves an object behind fails, and the object is removed either way.
    """
    import posix_ipc

    from ipc.shm import list_segments, list_semaphores

    segs, sems = list_segments(prefix), list_semaphores(prefix)
    for name in segs:
        posix_ipc.unlink_shared_memory(name)
    for name in sems:
        posix_ipc.unlink_semaphore(name)
    assert (segs, sems) == ([], [])
