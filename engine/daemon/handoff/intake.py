"""A board's side of a prefill/decode hand-off: what a generate's `handoff` field does here.

An export leg needs nothing from this module: a prefill board with a disk KV tier and write-through
(`kv.disk_dir`, `kv.write_through`) already writes every full prompt block it computes to a block file
named by its chain hash, with its layout tag and a checksum (engine/core/tier_transfers.py).

A decode leg's descriptor goes to `PeerDiskSink` when this board names such a board's `kv.disk_dir` in
`board.handoff_peer_dirs`: the prompt's chain hashes are computed here (equal prefixes, equal model and
KV layout give equal hashes on every board), each block file of the peer is linked into this board's
disk tier and indexed, and the scheduler promotes those blocks at admission instead of computing them.
A link to a file the peer has not finished writing, has evicted or wrote in another layout is refused
by the worker's record check and those tokens are recomputed: never wrong output, never a lost request.
Without a sink (no peer dirs, no disk tier) every take-over recomputes the prompt, which is what the
request's `continuation` already asks for. The counters say which happened.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from engine.core.handoff import HandoffDescriptor, ImportOutcome, KvHandoffSink, take_over
from engine.core.kv.chain_hash import chain_of
from engine.daemon.handoff.hold import HandoffHold

HANDOFF_COUNTER_KEYS = ("handoff_exports", "handoff_imported", "handoff_recomputed", "handoff_staged_blocks",
                        "handoff_held", "handoff_expired",
                        # the transfer endpoint (transfer.py): prefill side, then decode side
                        "handoff_claimed", "handoff_claims_refused", "handoff_released", "handoff_served_blocks",
                        "handoff_pulled_blocks", "handoff_pull_failed", "handoff_pull_us",
                        # one host, from the prefill board's host slot pool (shm.py)
                        "handoff_shm_blocks", "handoff_shm_refused")


class PeerDiskSink:
    """Stage a hand-off's blocks from a prefill board's disk tier on this host into this board's."""

    def __init__(self, shell, peer_dirs: Sequence[str]) -> None:
        self.shell = shell  # engine.daemon.kv_tier_shell.KvTierShell of the generation
        self.peers = [os.path.join(d, shell.layout_hex) for d in peer_dirs]

    def stage(self, desc: HandoffDescriptor, tokens: Sequence[int], salt: str) -> int:
        tiers, own = self.shell.tiers, self.shell.disk_dir
        if tiers.disk is None or own is None or not self.peers:
            return 0
        bs = tiers.block_size
        n_prompt = min(len(tokens), desc.prompt_len) if desc.prompt_len else len(tokens)
        chains = chain_of(tiers.root(salt), tokens[:((n_prompt - 1) // bs) * bs], bs)
        if not chains:
            return 0
        first = chains[0].hex() + ".kv"
        peer = next((d for d in self.peers if os.path.exists(os.path.join(d, first))), self.peers[0])
        staged = 0
        for c in chains:
            if c in tiers.disk or (tiers.host is not None and c in tiers.host):
                staged += 1  # already here (an earlier hand-off, or this board's own prefix)
                continue
            name = c.hex() + ".kv"
            try:
                os.symlink(os.path.join(peer, name), os.path.join(own, name))
            except FileExistsError:
                pass
            except OSError:
                break
            if tiers.disk.adopt(c) is None:  # the disk tier is full of pinned blocks: the rest is recomputed
                break
            staged += 1
        return staged


def sink_for(g, cfg) -> KvHandoffSink | None:
    """The generation's sink, when this board imports hand-offs (peer dirs and a disk tier of its own)."""
    shell = getattr(g, "kv_tiers", None)
    if not cfg.board.handoff_peer_dirs or shell is None or shell.disk_dir is None:
        return None
    return PeerDiskSink(shell, cfg.board.handoff_peer_dirs)


def note_handoff(counters: dict[str, int], handoff: dict, sink: KvHandoffSink | None = None,
                 tokens: Sequence[int] = (), salt: str = "") -> ImportOutcome | None:
    """Count (and, with a sink, stage the import of) one generate's hand-off; None for an export leg."""
    if handoff.get("export"):
        counters["handoff_exports"] = counters.get("handoff_exports", 0) + 1
        return None
    outcome, staged = take_over(HandoffDescriptor.from_wire(handoff), sink, tokens, salt)
    key = f"handoff_{outcome.value}"
    counters[key] = counters.get(key, 0) + 1
    counters["handoff_staged_blocks"] = counters.get("handoff_staged_blocks", 0) + staged
    return outcome


def take_handoff(g, cfg, rid: int, handoff: dict, params, now: float,
                 advertise: dict | None = None) -> dict | None:
    """A generate's `handoff` on generation `g`: an export leg is held (prefill side), a decode leg staged.

    Returns an export leg's descriptor when its blocks are held (sent in its `done`), with `advertise`
    (the transfer endpoint's fields, engine/daemon/handoff/transfer.py) in it."""
    note_handoff(g.counters, handoff, sink_for(g, cfg), params.prompt, params.prefix_salt)
    shell = getattr(g, "kv_tiers", None)
    if handoff.get("export") and shell is not None and shell.disk_dir is not None:
        if g.handoff_hold is None:
            g.handoff_hold = HandoffHold(cfg.board.handoff_deadline_s)
        hid = f"r{rid}"
        if g.handoff_hold.hold(shell, hid, params.prompt, params.prefix_salt, now):
            g.counters["handoff_held"] = g.counters.get("handoff_held", 0) + 1
            return {"board": cfg.board.id, "request": hid, "prompt_len": len(params.prompt), "blocks": [],
                    **(advertise or {})}
    return None


def tick_holds(g, now: float) -> None:
    """The supervision turn: pin what was exported since, let go of what is past its deadline."""
    if g.handoff_hold is not None and g.kv_tiers is not None:
        n = g.handoff_hold.tick(g.kv_tiers, now)
        if n:
            g.counters["handoff_expired"] = g.counters.get("handoff_expired", 0) + n
