"""A hand-off between two boards on one host, read straight from the prefill board's host KV slot pool.

The prefill board's host tier is one POSIX shared-memory segment of equal slots (`kv.host_pool_mb`,
ipc/kv_slots.py), and write-through puts every full prompt block there as a record (layout tag, chain
hash, CRC in its header). An export leg's descriptor names that segment (`host_pool`: its name, slots,
slot size, layout tag and the host's id); the hold pins the blocks' host entries as well as their disk
ones (hold.py), so the prefill board neither frees nor reuses those slots until the hold ends.

A decode board on the same host (equal host id: hostname and kernel boot id) with the same layout and a
disk tier of its own opens the segment read-only, finds each of the prompt's blocks by the chain hash
in the slot headers (its own chain hashes of the prompt, so a slot holding anything else never matches),
copies the record out, checks the copy (layout, chain hash, CRC: a slot overwritten or torn meanwhile
fails here), writes it into its disk tier as a block file and closes the segment; its scheduler then
promotes those blocks at admission as it does any disk-tier block. No network copy, no shared directory.
The first block it cannot take ends the copy (the rest is recomputed); none taken, and the caller goes
on to the ZeroMQ pull (`endpoint` in the descriptor) or recomputes: never wrong output.

A release goes to the prefill board's transfer endpoint when the descriptor names one (one message,
no reply awaited), so the hold ends now; without one the hold lasts `board.handoff_deadline_s`.
"""

from __future__ import annotations

import json
import os
import socket

import posix_ipc
import zmq

from engine.daemon.handoff.transfer import handoff_chains, stage_records
from engine.daemon.log import log
from ipc.kv_slots import HEADER_BYTES, KvSlotPool, RecordRefused, read_record


def host_id() -> str:
    """Equal on two boards that can map each other's /dev/shm (one kernel), different across hosts."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def advertise(g) -> dict:
    """The export descriptor's `host_pool` field, when this generation has a host slot pool."""
    shell = getattr(g, "kv_tiers", None)
    pool = None if shell is None else shell.pool
    if pool is None:
        return {}
    return {"host_pool": {"name": pool.name, "slots": pool.slots, "slot_bytes": pool.slot_bytes,
                          "layout": shell.layout_hex, "host": host_id()}}


def _count(g, key: str, n: int = 1) -> None:
    g.counters[key] = g.counters.get(key, 0) + n


def take_from_host_pool(g, handoff: dict, params, ctx: zmq.Context | None = None) -> bool:
    """Stage a decode leg's blocks from the prefill board's host pool; True when at least one was staged
    (the request is then submitted as an imported hand-off), False: the caller goes on as before."""
    hp = handoff.get("host_pool")
    shell = getattr(g, "kv_tiers", None)
    if handoff.get("export") or not isinstance(hp, dict) or shell is None or shell.disk_dir is None:
        return False
    if hp.get("host") != host_id() or hp.get("layout") != shell.layout_hex or hp.get("slot_bytes") != shell.slot_bytes:
        return False  # another host, model or KV layout: the pull (or a recompute) it is
    chains, have = handoff_chains(shell.tiers, params, handoff)
    if not chains or have == len(chains):
        return False
    records, reason = _copy(hp, shell.layout, chains[have:])
    staged = stage_records(shell, chains[have:], records) if records else 0
    if not staged:
        log("handoff_shm_refused", segment=hp.get("name"), reason=reason or "staging")
        _count(g, "handoff_shm_refused")
        return False
    _count(g, "handoff_imported")
    _count(g, "handoff_staged_blocks", staged)
    _count(g, "handoff_shm_blocks", staged)
    if handoff.get("endpoint") and ctx is not None:
        _release(ctx, handoff, staged)
    return True


def _copy(hp: dict, layout: int, chains: list[bytes]) -> tuple[list[bytes], str | None]:
    """The checked records of `chains` in order, up to the first missing or refused one; and why it stopped."""
    try:
        pool = KvSlotPool.attach(str(hp["name"]), int(hp["slots"]), int(hp["slot_bytes"]), read_only=True)
    except (posix_ipc.Error, OSError, ValueError, KeyError, TypeError) as e:
        return [], f"segment: {e}"
    out: list[bytes] = []
    reason = None
    try:
        h = pool.headers()
        slot_of = {bytes(ch): i for i, ch in enumerate(h["chain"])}  # a slot per chain hash in its header
        for c in chains:
            i = slot_of.get(c.ljust(16, b"\0")[:16])
            if i is None:
                reason = "block not in the peer's host pool"
                break
            n = min(int(h["n"][i]), pool.slot_bytes - HEADER_BYTES)
            rec = bytes(pool.slot(i)[:HEADER_BYTES + n])  # the copy is what gets checked (the slot may change)
            try:
                read_record(memoryview(rec), layout, c)
            except RecordRefused as e:
                reason = f"record refused ({e.cause})"
                break
            out.append(rec)
        del h
    finally:
        pool.close()
    return out, reason


def _release(ctx: zmq.Context, handoff: dict, staged: int) -> None:
    """Tell the prefill board's transfer endpoint the blocks are here (one message; its loss only means
    the hold lasts its deadline)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 500)
    s.setsockopt(zmq.SNDHWM, 1)
    if handoff.get("curve_key"):  # a CURVE endpoint needs this board's keys: the hold lasts its deadline
        s.close(0)
        return
    try:
        s.connect(handoff["endpoint"])
        s.send(json.dumps({"t": "release", "tid": f"{os.getpid()}-shm", "hid": str(handoff["request"]),
                           "ok": True, "blocks": staged}).encode(), zmq.NOBLOCK)
    except (zmq.ZMQError, KeyError):
        pass
    finally:
        s.close()
