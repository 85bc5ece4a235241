"""Shared-memory segments, names and stale-object reaping (real /dev/shm)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import warnings

import numpy as np
import posix_ipc
import pytest

from shm_sweep import sweep_shm
from ipc.doorbell import SemaphoreDoorbell
from ipc.naming import make_name, parse_owner_pid
from ipc.shm import SHM_PREFIX, Segment, list_segments, list_semaphores, parse_owner_pid as shm_parse, reap_stale

PREFIX = f"nptshm{os.getpid()}"


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves an object behind, and remove it either way."""
    yield
    sweep_shm(PREFIX)


def test_create_names_segment_with_prefix_board_pid_tag_and_mode_0600():
    with Segment.create(PREFIX, "b7", 4096, "jobs") as seg:
        assert seg.name.startswith(f"/{PREFIX}-b7-{os.getpid()}-jobs")
        assert len(seg.name) > len(f"/{PREFIX}-b7-{os.getpid()}-jobs")  # random part follows the tag
        assert seg.owner_pid == os.getpid()
        st = os.stat("/dev/shm" + seg.name)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 4096 and seg.size == 4096 and len(seg.buf) == 4096
        assert list_segments(PREFIX) == [seg.name]


def test_two_segments_of_one_owner_get_distinct_names():
    with Segment.create(PREFIX, 0, 64) as a, Segment.create(PREFIX, 0, 64) as b:
        assert a.name != b.name
        assert sorted(list_segments(PREFIX)) == sorted([a.name, b.name])


def test_attach_shares_memory_and_does_not_unlink_on_exit():
    with Segment.create(PREFIX, 0, 128) as seg:
        with Segment.attach(seg.name) as other:
            assert other.size == 128 and other.owner_pid == os.getpid()
            other.buf[:5] = b"hello"
        assert bytes(seg.buf[:5]) == b"hello"
        assert list_segments(PREFIX) == [seg.name]  # attacher's exit left it in place


def test_create_refuses_an_existing_name_and_bad_fields():
    with pytest.raises(ValueError):
        Segment.create("has-dash", 0, 64)
    with pytest.raises(ValueError):
        Segment.create(PREFIX, "a-b", 64)
    with pytest.raises(ValueError):
        Segment.create(PREFIX, 0, 0)
    with Segment.create(PREFIX, 0, 64) as seg:
        with pytest.raises(posix_ipc.ExistentialError):
            posix_ipc.SharedMemory(seg.name, posix_ipc.O_CREX, size=64)


def test_close_and_unlink_are_idempotent_and_attach_after_unlink_fails():
    seg = Segment.create(PREFIX, 0, 64)
    seg.close()
    seg.close()
    assert seg.closed
    seg.unlink()
    seg.unlink()
    with pytest.raises(posix_ipc.ExistentialError):
        Segment.attach(seg.name)


def test_close_with_live_view_defers_unmap_and_keeps_view_valid():
    seg = Segment.create(PREFIX, 0, 4096)
    view = np.frombuffer(seg.buf, np.uint8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seg.close()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    assert seg.closed
    assert int(view.sum()) == 0  # still mapped: reading does not crash
    seg.unlink()
    del view


@pytest.mark.parametrize(
    "name, pid",
    [
        ("/npuserve-0-1234-ringab12cd34", 1234),
        ("npuserve-board.1-77-", 77),
        ("sem.npuserve-0-42-bellffff0000", 42),
        ("/npuserve-0-42-tag-with-dashes00", 42),
        ("/npuserve-0-notapid-x", None),
        ("/npuserve-0", None),
        ("/other", None),
        ("/npuserve-0-0-x", None),
    ],
)
def test_parse_owner_pid(name, pid):
    assert parse_owner_pid(name) == pid
    assert shm_parse(name) == pid


def test_make_name_roundtrips_owner_pid():
    assert parse_owner_pid(make_name(PREFIX, 3, "x", pid=987654)) == 987654


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_reap_stale_removes_only_objects_of_dead_owners():
    dead = _dead_pid()
    dead_seg = make_name(PREFIX, 0, "seg", pid=dead)
    dead_sem = make_name(PREFIX, 0, "sem", pid=dead)
    posix_ipc.SharedMemory(dead_seg, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
    posix_ipc.Semaphore(dead_sem, posix_ipc.O_CREX, mode=0o600).close()
    with Segment.create(PREFIX, 0, 64, "live") as live, SemaphoreDoorbell.create(PREFIX, 0, "live") as bell:
        removed = reap_stale(PREFIX)
        assert sorted(removed) == sorted([dead_seg, dead_sem])
        assert list_segments(PREFIX) == [live.name]
        assert list_semaphores(PREFIX) == [bell.name]
        assert reap_stale(PREFIX) == []  # nothing left to reap
        assert reap_stale("someoneelse") == []


def test_reap_stale_treats_a_recycled_pid_as_dead():
    """A live process whose pid matches but that started after the segment was
    made cannot be its owner (pid reuse)."""
    name = make_name(PREFIX, 0, "old", pid=os.getpid())
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
    try:
        os.utime("/dev/shm" + name, (1_000_000, 1_000_000))  # as if made in 1970
        assert reap_stale(PREFIX) == [name]
    finally:
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
