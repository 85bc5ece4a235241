"""Doorbells: semantics in one process, and a real idle reader process that must sleep."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import zmq

from idle_activity import idle_activity
from shm_sweep import sweep_shm
import ipc.doorbell as doorbell_mod
from ipc.doorbell import SemaphoreDoorbell, ZmqDoorbell
from ipc.ring import Ring
from ipc.shm import list_semaphores

PREFIX = f"nptbell{os.getpid()}"


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves an object behind, and remove it either way."""
    yield
    sweep_shm(PREFIX)


@pytest.fixture(params=["semaphore", "zmq"])
def bell_pair(request, tmp_path):
    """(ringer, waiter) for each doorbell kind."""
    if request.param == "semaphore":
        a = SemaphoreDoorbell.create(PREFIX, 0, "t")
        b = SemaphoreDoorbell.attach(a.name)
        yield a, b
        b.close()
        a.close()
        a.unlink()
    else:
        ep = f"ipc://{tmp_path}/bell"
        a = ZmqDoorbell.create(ep)
        b = ZmqDoorbell.attach(ep)
        yield a, b
        b.close()
        a.close()
        assert not os.path.exists(f"{tmp_path}/bell")


def test_wait_without_ring_times_out_false(bell_pair):
    _, waiter = bell_pair
    assert waiter.wait(0) is False
    assert waiter.wait(0.01) is False


def test_ring_then_wait_is_true(bell_pair):
    ringer, waiter = bell_pair
    ringer.ring()
    assert waiter.wait(5) is True


def test_semaphore_burst_of_rings_costs_one_wait():
    with SemaphoreDoorbell.create(PREFIX, 0, "burst") as a:
        b = SemaphoreDoorbell.attach(a.name)
        for _ in range(5):
            a.ring()
        assert b.wait(0) is True
        assert b.wait(0) is False  # the other four rings were drained by the first wait
        b.close()


_RACE_WRITER = """
import mmap, random, sys, time
import numpy as np
import ipc.doorbell as doorbell_mod
from ipc.doorbell import SemaphoreDoorbell, ZmqDoorbell
from ipc.ring import Ring
kind, bell_name, ring_name, flag_path = sys.argv[1:5]
n, seed, spin_s = int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
bell = SemaphoreDoorbell.attach(bell_name) if kind == "semaphore" else ZmqDoorbell.attach(bell_name)
ring = Ring.attach(ring_name)
with open(flag_path, "r+b") as fh:
    flag = np.frombuffer(mmap.mmap(fh.fileno(), 8), np.int64)
rng = random.Random(seed)
for i in range(n):
    while flag[0] < i:  # lockstep: record i only once the reader looks for it, so a lost ring is never rescued
        time.sleep(0)
    if spin_s <= 0:  # commit (and deliver) before, during or after the reader's empty peek
        pause = rng.random() * 120e-6
    else:
        # phases of quick and late rings (the reader's spin turns off and on), with pauses spread around the
        # spin threshold so rings land inside the spin, just after it, and while the reader parks; and a phase
        # of rings within tens of microseconds, which land between the reader's empty peek and its park
        phase = (i // 150) % 4
        pause = rng.random() * (30e-6 if phase == 2 else spin_s * (0.5 if phase == 0 else 3.0 if phase == 1 else 1.6))
    end = time.perf_counter() + pause
    while time.perf_counter() < end:
        pass
    ring.write({"x": np.array([i])})
    bell.ring()
ring.close()
bell.close()
"""


def _shared_flag(tmp_path):
    """The reader's "about to look for record i" flag, shared with the writer process through a mapped file."""
    import mmap

    path = tmp_path / "flag"
    path.write_bytes(np.full(1, -1, np.int64).tobytes())
    with open(path, "r+b") as fh:
        return path, np.frombuffer(mmap.mmap(fh.fileno(), 8), np.int64)


@pytest.mark.parametrize("kind", ["semaphore", "zmq"])
def test_ring_between_empty_peek_and_wait_is_not_lost(kind, tmp_path):
    """A real race, repeated: a writer process commits and rings just as this
    reader goes from an empty peek to parking. A ring that lands in between
    must wake the park; a lost one leaves the reader asleep with a record in
    the ring. The writer starts each record when the reader announces it is
    about to look (a shared flag), after a random 0-120 us (a ZeroMQ ring takes tens of us to arrive), so the ring falls
    before, inside and after the peek-to-park window across the repetitions."""
    n = 1500
    flag_path, flag = _shared_flag(tmp_path)
    with Ring.create(PREFIX, 0, 4096, "race") as ring:
        if kind == "semaphore":
            ringer = SemaphoreDoorbell.create(PREFIX, 0, "race")
            waiter = SemaphoreDoorbell.attach(ringer.name, spin_s=0.0)  # park at once: the racy path
            bell_name = ringer.name
        else:
            bell_name = f"ipc://{tmp_path}/race"
            ringer, waiter = None, ZmqDoorbell.create(bell_name)  # the writer process connects and rings
        proc = subprocess.Popen([sys.executable, "-c", _RACE_WRITER, kind, bell_name, ring.name, str(flag_path),
                                 str(n), "7", "0"])
        try:
            parks = 0
            for i in range(n):
                flag[0] = i
                while (rec := ring.peek()) is None:
                    parks += 1
                    if not waiter.wait(10.0):  # only a lost wake-up (or a writer stalled 10 s) sleeps that long
                        assert ring.peek() is None, f"record {i} was committed and rung, but the wait slept through it"
                        assert proc.poll() is None, f"the writer exited with record {i} unread"
                assert int(rec["x"][0]) == i
                del rec
                ring.release()
            assert proc.wait(30) == 0
            assert parks > n // 4, f"the reader parked only {parks} times: the race was hardly exercised"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            waiter.close()
            if ringer is not None:
                ringer.close()
                ringer.unlink()


def test_adaptive_spin_stops_when_rings_come_late_and_resumes_when_they_come_quickly(monkeypatch):
    """The adaptive policy, with a spin window (50 ms) far longer than a loaded host's wake-up latency:
    waits that no ring ends within spin_s turn the spin off; parked waits that a ring ends quickly (a
    thread rings 1 ms in) turn it back on. A fixed spin never stops (the control)."""
    import threading

    with SemaphoreDoorbell.create(PREFIX, 0, "adapt") as ringer:
        fixed = SemaphoreDoorbell.attach(ringer.name, spin_s=0.05)
        waiter = SemaphoreDoorbell.attach(ringer.name, spin_s=0.05, adaptive=True)
        try:
            assert waiter.spinning
            late = 0
            while waiter.spinning:
                assert waiter.wait(0.06) is False  # spins 50 ms, parks 10 ms: nothing came
                late += 1
                assert late <= 16, "the spin never stopped although no ring came within spin_s"
            assert late >= 8, f"one slow spell of {late} waits turned the spin off: the share is not averaged"
            spins: list[float] = []

            def spin_until(check, spin_s):
                spins.append(spin_s)
                return real_spin_until(check, spin_s)

            real_spin_until = doorbell_mod._spin_until
            monkeypatch.setattr(doorbell_mod, "_spin_until", spin_until)
            assert waiter.wait(0.002) is False
            assert spins == []  # not spinning: it parked at once, no 50 ms spin first
            assert fixed.wait(0.06) is False
            assert spins == [0.05]  # (the spy sees a spin when there is one)
            monkeypatch.undo()
            for _ in range(4):
                assert fixed.wait(0.06) is False
            assert fixed.spinning, "a non-adaptive doorbell must keep its fixed spin"
            quick = 0
            while not waiter.spinning:
                threading.Timer(0.001, ringer.ring).start()
                assert waiter.wait(5.0) is True  # parked, rung ~1 ms in: a spin would have caught it
                quick += 1
                assert quick <= 40, "quick rings never turned the spin back on"
        finally:
            fixed.close()
            waiter.close()


@pytest.mark.parametrize("spin_s", [30e-6, 1e-3])
def test_adaptive_spin_loses_no_wake_up_under_a_racing_writer_process(tmp_path, spin_s):
    """Stress: a writer process commits and rings thousands of records, each once the reader looks for
    it (lockstep, so a lost ring is never rescued by the next one), after pauses around the reader's
    spin threshold, in phases that switch the adaptive spin off and on; the reader (spin, then park)
    must see every record, in order, and no wait may sleep through a committed record (a wait that
    times out with a record present fails the test instead of hanging it)."""
    # 30 us: most waits outlast the window (the spin is mostly off, rings race the park); 1 ms: far above a
    # loaded host's wake-up latency, so the quick and the late phases switch the spin on and off
    n = 2400
    flag_path, flag = _shared_flag(tmp_path)
    with Ring.create(PREFIX, 0, 1 << 16, "astress") as ring:
        ringer = SemaphoreDoorbell.create(PREFIX, 0, "astress")
        waiter = SemaphoreDoorbell.attach(ringer.name, spin_s=spin_s, adaptive=True)
        proc = subprocess.Popen([sys.executable, "-c", _RACE_WRITER, "semaphore", ringer.name, ring.name,
                                 str(flag_path), str(n), "11", str(spin_s)])
        try:
            spun = parked = 0
            deadline = time.monotonic() + 120
            for i in range(n):
                flag[0] = i
                while (rec := ring.peek()) is None:
                    if waiter.spinning:
                        spun += 1
                    else:
                        parked += 1
                    if not waiter.wait(5.0):
                        assert ring.peek() is None, f"record {i} was committed and rung, but the wait slept through it"
                        assert proc.poll() is None, f"the writer exited with record {i} unread"
                    assert time.monotonic() < deadline, "the stress run took far too long"
                assert int(rec["x"][0]) == i
                del rec
                ring.release()
            assert proc.wait(30) == 0
            assert parked > 20, f"parked {parked} times: the park was hardly exercised"
            if spin_s >= 1e-3:
                assert spun > 20, f"spinning {spun}, parked {parked}: the policy hardly switched"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            waiter.close()
            ringer.close()
            ringer.unlink()


def test_semaphore_doorbell_name_and_mode():
    with SemaphoreDoorbell.create(PREFIX, "b1", "jobs") as bell:
        assert bell.name.startswith(f"/{PREFIX}-b1-{os.getpid()}-jobs")
        assert bell.owner_pid == os.getpid()
        mode = stat.S_IMODE(os.stat(f"/dev/shm/sem.{bell.name[1:]}").st_mode)
        assert mode == 0o600
        assert list_semaphores(PREFIX) == [bell.name]


def test_semaphore_close_and_unlink_are_idempotent():
    bell = SemaphoreDoorbell.create(PREFIX, 0)
    bell.close()
    bell.close()
    bell.unlink()
    bell.unlink()
    with pytest.raises(ValueError):
        bell.ring()


def test_zmq_doorbell_socket_works_in_a_poller(tmp_path):
    ep = f"ipc://{tmp_path}/p"
    with ZmqDoorbell.create(ep) as a, ZmqDoorbell.attach(ep) as b:
        poller = zmq.Poller()
        poller.register(b.socket, zmq.POLLIN)
        assert dict(poller.poll(0)) == {}
        a.ring()
        assert dict(poller.poll(5000)).get(b.socket) == zmq.POLLIN
        assert b.wait(0) is True


IDLE_WINDOW_S = 2.0
_IDLE_READER = r"""
import sys
from ipc.ring import Ring
import ipc.doorbell as doorbell_mod
from ipc.doorbell import SemaphoreDoorbell, ZmqDoorbell
ring = Ring.attach(sys.argv[1])
bell = SemaphoreDoorbell.attach(sys.argv[3]) if sys.argv[2] == "semaphore" else ZmqDoorbell.attach(sys.argv[3])
print("ready", flush=True)
while True:
    rec = ring.peek()
    if rec is None:
        bell.wait(0.2)
        continue
    stop = "stop" in rec
    ring.release()
    if stop:
        break
print("bye", flush=True)
ring.close(); bell.close()
"""


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["semaphore", "zmq"])
def test_idle_reader_process_sleeps_and_still_wakes(kind, tmp_path):
    with Ring.create(PREFIX, 0, 4096, "idle") as ring:
        if kind == "semaphore":
            bell = SemaphoreDoorbell.create(PREFIX, 0, "idle")
            addr = bell.name
        else:
            addr = f"ipc://{tmp_path}/idle"
            bell = ZmqDoorbell.create(addr)
        proc = subprocess.Popen(
            [sys.executable, "-c", _IDLE_READER, ring.name, kind, addr], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout.readline().strip() == "ready"
            ps = psutil.Process(proc.pid)
            time.sleep(0.3)  # let the reader settle into its idle loop
            # wait(0.2) wakes it 5 times a second; polling or spinning would wake or burn far more
            act = idle_activity([ps], window_s=IDLE_WINDOW_S, max_wakeups_per_s=20, max_cpu_share=0.05)
            assert act.wakeups_per_s <= 20, f"idle reader woke too often: {act}"
            assert act.cpu_share <= 0.05, f"idle reader spun between wake-ups: {act}"
            ring.write({"stop": np.zeros(1)})
            bell.ring()
            assert proc.stdout.readline().strip() == "bye"
            assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            bell.close()
            if isinstance(bell, SemaphoreDoorbell):
                bell.unlink()
