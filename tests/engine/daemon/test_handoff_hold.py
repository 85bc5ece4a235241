"""A prefill board's held hand-offs: the prompt's disk-tier blocks pinned until the deadline (fake clock)."""

from __future__ import annotations

from types import SimpleNamespace

from engine.core.kv.chain_hash import chain_of
from engine.core.tier_transfers import KvTiers
from engine.daemon.handoff.hold import HandoffHold

BS = 4


def shell(capacity: int):
    return SimpleNamespace(tiers=KvTiers("tag", BS, disk_blocks=capacity), disk_dir="/nowhere")


def export(sh, chains):
    for c in chains:
        e = sh.tiers.disk.claim(c)
        sh.tiers.disk.filled(e, True)


def test_held_blocks_survive_eviction_until_the_deadline_then_go():
    sh = shell(capacity=3)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks before the last token
    chains = chain_of(sh.tiers.root(""), prompt[:8], BS)
    hold = HandoffHold(deadline_s=5.0)
    assert hold.hold(sh, "r1", prompt, "", now=0.0) == 2
    assert hold.pinned_blocks() == 0  # not exported yet
    export(sh, chains)
    assert hold.tick(sh, now=1.0) == 0 and hold.pinned_blocks() == 2
    others = [bytes([i]) * 16 for i in range(5)]
    export(sh, others[:3])  # the tier is full: each new block evicts the unpinned one, never the held ones
    assert all(c in sh.tiers.disk for c in chains) and others[0] not in sh.tiers.disk
    assert hold.tick(sh, now=5.0) == 1 and hold.pinned_blocks() == 0
    export(sh, others[3:5])  # now the hand-off's blocks are evictable like any other
    assert not all(c in sh.tiers.disk for c in chains)
    sh.tiers.disk.check_invariants()


def test_a_prompt_without_a_full_block_holds_nothing():
    sh = shell(capacity=3)
    hold = HandoffHold(deadline_s=5.0)
    assert hold.hold(sh, "r1", [1, 2, 3, 4], "", now=0.0) == 0 and len(hold.table) == 0


def test_the_held_blocks_host_slots_are_pinned_until_the_release():
    """A decode board on this host reads those slots (handoff/shm.py): none is freed or reused meanwhile."""
    sh = SimpleNamespace(tiers=KvTiers("tag", BS, host_slots=2, disk_blocks=8), disk_dir="/nowhere")
    prompt = list(range(1, 11))
    chains = chain_of(sh.tiers.root(""), prompt[:8], BS)
    for c in chains:
        for tier in (sh.tiers.host, sh.tiers.disk):
            tier.filled(tier.claim(c), True)
    hold = HandoffHold(deadline_s=60.0)
    assert hold.hold(sh, "r1", prompt, "", now=0.0) == 2
    slots = [sh.tiers.host.entry(c).slot for c in chains]
    assert sh.tiers.host.claim(b"\1" * 16) is None  # the pool is full of held slots: nothing is evicted
    assert hold.claim("r1", now=1.0) is not None and hold.release(sh, "r1")
    e = sh.tiers.host.claim(b"\1" * 16)  # released: evictable (and reusable) again
    assert e is not None and e.slot in slots
    sh.tiers.host.check_invariants()
