"""A worker's adapters: the ones the board registered, a host cache of read ones, and the device slots.

The daemon registers an adapter (`LORA_ADD`: its board number, path and
manifest sha256) on every chip and drops it (`LORA_DROP`) when it is
unloaded; a job names adapters by board number (`Job.adapter`). Before the
job runs, `slots_for` puts each adapter it names into a device slot: a hit
costs nothing, a miss reads the adapter into the host cache (at most
`max_cached` adapters, least recently used dropped first) unless it is there,
then loads it into the least recently used slot the job does not use. The
time that takes is the swap time the metrics report. A job needing more
adapters than there are slots, or naming an unregistered one, is refused
(`AdapterError`) before anything runs.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np


class AdapterError(ValueError):
    """A job's adapters cannot be put on the device (the job is refused, the worker serves on)."""


class AdapterBook:
    def __init__(self, backend, slots: int, max_cached: int) -> None:
        self.backend = backend
        self.n_slots = max(0, int(slots))
        self.max_cached = max(1, int(max_cached))
        self.registered: dict[int, tuple[str, str]] = {}  # board number -> (path, manifest sha256)
        self.host: OrderedDict[int, object] = OrderedDict()  # read adapters, least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter on the device -> slot, LRU first
        self.free = list(range(self.n_slots))
        self.swaps = 0
        self.swap_s = 0.0

    # ---- registration (control messages) -------------------------------------------------------------
    def add(self, number: int, path: str, sha256: str) -> None:
        if self.registered.get(number) != (path, sha256):
            self.drop(number)
        self.registered[number] = (path, sha256)

    def drop(self, number: int) -> None:
        """Forget an adapter: its host copy and its device slot are freed."""
        self.registered.pop(number, None)
        self.host.pop(number, None)
        slot = self.slot_of.pop(number, None)
        if slot is not None:
            self.backend.unload_adapter(slot)
            self.free.append(slot)

    # ---- per job --------------------------------------------------------------------------------------
    def slots_for(self, adapter: np.ndarray) -> np.ndarray:
        """Job.adapter (board numbers, -1 base) as device slots, swapping adapters in as needed."""
        wanted = [int(x) for x in np.unique(adapter) if x >= 0]
        if len(wanted) > self.n_slots:
            raise AdapterError(f"the job names {len(wanted)} adapters; this chip holds {self.n_slots}")
        for n in wanted:
            if n not in self.registered:
                raise AdapterError(f"adapter {n} is not loaded on this board")
        keep = set(wanted)
        for n in wanted:
            if n in self.slot_of:
                self.slot_of.move_to_end(n)
            else:
                self._swap_in(n, keep)
        out = np.full(adapter.shape, -1, np.int32)
        for n in wanted:
            out[adapter == n] = self.slot_of[n]
        return out

    def _swap_in(self, number: int, keep: set[int]) -> None:
        t0 = time.perf_counter()
        host = self.host.get(number)
        if host is None:
            path, sha = self.registered[number]
            try:
                host = self.backend.read_adapter(path, sha)
            except Exception as e:  # noqa: BLE001 - a damaged file fails the job, not the worker
                raise AdapterError(f"adapter {number}: {e}") from e
            self.host[number] = host
            while len(self.host) > self.max_cached:
                victim = next(n for n in self.host if n != number)
                del self.host[victim]
        else:
            self.host.move_to_end(number)
        if self.free:
            slot = self.free.pop()
        else:
            victim = next(n for n in self.slot_of if n not in keep)  # exists: len(keep) <= slots
            slot = self.slot_of.pop(victim)
        self.backend.load_adapter(slot, host)
        self.slot_of[number] = slot
        self.swaps += 1
        self.swap_s += time.perf_counter() - t0

    def stats(self) -> dict:
        return {"loaded": len(self.slot_of), "cached": len(self.host), "registered": len(self.registered),
                "slots": self.n_slots, "swaps": self.swaps, "swap_s": round(self.swap_s, 6)}
