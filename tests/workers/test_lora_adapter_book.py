"""The worker's adapter book: device slots swapped LRU (never one the job uses), a bounded host cache,
registration and drops, refusals before anything runs."""

from __future__ import annotations

import numpy as np
import pytest

from workers.lora.adapter_book import AdapterBook, AdapterError


class FakeBackend:
    def __init__(self) -> None:
        self.reads: list[str] = []
        self.device: dict[int, str] = {}

    def read_adapter(self, path: str, sha256: str) -> str:
        if path == "broken":
            raise ValueError("sha256 does not match the manifest")
        self.reads.append(path)
        return f"host:{path}"

    def load_adapter(self, slot: int, host) -> None:
        self.device[slot] = host

    def unload_adapter(self, slot: int) -> None:
        del self.device[slot]


def _book(slots=2, cached=3):
    be = FakeBackend()
    book = AdapterBook(be, slots, cached)
    for n in range(1, 6):
        book.add(n, f"p{n}", "s")
    return be, book


def test_a_job_gets_device_slots_and_lanes_keep_their_own_adapter():
    be, book = _book()
    slots = book.slots_for(np.array([1, -1, 2, 1], np.int32))
    assert slots[1] == -1 and slots[0] == slots[3] != slots[2]
    assert be.device[int(slots[0])] == "host:p1" and be.device[int(slots[2])] == "host:p2"
    assert book.swaps == 2 and book.stats()["loaded"] == 2


def test_a_swap_evicts_the_least_recently_used_adapter_the_job_does_not_use():
    be, book = _book()
    book.slots_for(np.array([1], np.int32))
    book.slots_for(np.array([2], np.int32))
    book.slots_for(np.array([1], np.int32))  # 2 is now the least recently used
    s = book.slots_for(np.array([3, 1], np.int32))  # needs a slot: 2 goes, 1 (in this job) stays
    assert set(be.device.values()) == {"host:p1", "host:p3"}
    assert be.device[int(s[1])] == "host:p1"


def test_the_host_cache_is_bounded_and_saves_rereading():
    be, book = _book(slots=1, cached=2)
    for n in (1, 2, 1, 2):
        book.slots_for(np.array([n], np.int32))
    assert be.reads == ["p1", "p2"]  # swapped four times, read twice
    book.slots_for(np.array([3], np.int32))
    assert book.stats()["cached"] == 2 and book.swaps == 5


def test_refusals_name_the_cause_and_change_nothing():
    be, book = _book(slots=2)
    with pytest.raises(AdapterError, match="names 3 adapters; this chip holds 2"):
        book.slots_for(np.array([1, 2, 3], np.int32))
    with pytest.raises(AdapterError, match="adapter 9 is not loaded"):
        book.slots_for(np.array([9], np.int32))
    book.add(7, "broken", "s")
    with pytest.raises(AdapterError, match="sha256 does not match"):
        book.slots_for(np.array([7], np.int32))
    assert be.device == {} and book.swaps == 0


def test_a_drop_frees_its_slot_and_host_copy():
    be, book = _book()
    book.slots_for(np.array([1, 2], np.int32))
    book.drop(1)
    assert list(be.device.values()) == ["host:p2"] and book.stats()["cached"] == 1
    with pytest.raises(AdapterError):
        book.slots_for(np.array([1], np.int32))
    for _ in range(100):  # re-registering and dropping leaves nothing behind
        book.add(8, "p8", "s")
        book.slots_for(np.array([8], np.int32))
        book.drop(8)
    assert book.stats()["loaded"] == 1 and book.stats()["cached"] == 1 and len(book.free) == 1
