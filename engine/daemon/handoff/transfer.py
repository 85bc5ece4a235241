"""KV transfer between boards over ZeroMQ: the zmq shell around engine/core/kv_pull.py.

A prefill board with `board.handoff_endpoint` binds a ROUTER there (CURVE on
tcp:// when the board has `security.server_secret_key`) and advertises it in
each export leg's hand-off descriptor (`endpoint`, and `curve_key` with
CURVE). It serves a claimed hold's block records, in prompt order, from its
host slot pool when a block is there and from its disk tier's block file
otherwise: the records already carry layout tag, chain hash and CRC, so they
go on the wire as they are.

A decode board that gets such a descriptor (and has a disk tier of its own)
parks the generate, pulls the records with one DEALER per transfer, checks
each one against its own chain hashes of the prompt and its own layout,
writes them into its disk tier as block files and only then submits the
request: its scheduler promotes them at admission as it does any disk-tier
block. A failed or timed-out pull submits the request as it is: the prompt
is recomputed. Either way a release goes back, so the prefill board frees
the hold at once instead of at `board.handoff_deadline_s`.

Everything here runs on the daemon loop's thread: the sockets are in its
poller, and a turn moves at most the granted chunks (credit), so a transfer
never blocks the loop for longer than reading those records.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from engine.core.kv.chain_hash import chain_of
from engine.core.kv.tier_index import EntryState
from engine.core.kv_pull import DEFAULT_CREDIT, Pull, PullState, Serve
from engine.daemon.log import log
from ipc.kv_slots import read_record
from workers.kv_transfer import block_file

_tids = itertools.count(1)


def _count(g, key: str, n: int = 1) -> None:
    g.counters[key] = g.counters.get(key, 0) + n


def _send(sock: zmq.Socket, frames: list[bytes]) -> None:
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:  # the peer is not reading (its HWM is full): it will time out and recompute
        pass


class TransferServer:
    """The prefill side: serves held hand-offs on `board.handoff_endpoint`."""

    def __init__(self, ctx: zmq.Context, endpoint: str, gens, security=None, timeout_s: float = 2.0) -> None:
        self.gens = gens
        self.timeout_s = timeout_s
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.curve_key: str | None = None
        if security is not None and security.server_socket_options(self.sock, endpoint):
            self.curve_key = security.server_keys[0].decode()  # z85 public key
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT) if endpoint.endswith(":0") else endpoint
        self._serves: dict[tuple[bytes, str], tuple[Serve, object]] = {}

    def descriptor_fields(self) -> dict:
        out = {"endpoint": self.endpoint}
        if self.curve_key:
            out["curve_key"] = self.curve_key
        return out

    def _find(self, hid: str):
        for g in self.gens.serving_generations():
            hold = getattr(g, "handoff_hold", None)
            if hold is not None and g.kv_tiers is not None and hid in hold.table:
                return g, hold
        return None, None

    def on_readable(self, now: float) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) < 2:
                continue
            ident = frames[0]
            try:
                hdr = json.loads(frames[1])
                tid, hid = str(hdr["tid"]), str(hdr.get("hid", ""))
            except (ValueError, KeyError, TypeError):
                continue
            key = (ident, tid)
            if hdr.get("t") == "claim":
                self._claim(ident, key, hid, hdr, now)
                continue
            entry = self._serves.get(key)
            if entry is not None:
                entry[0].on_message(hdr, now)
            if hdr.get("t") == "release":
                self._release(hid, bool(hdr.get("ok")))
                self._serves.pop(key, None)

    def _claim(self, ident: bytes, key, hid: str, hdr: dict, now: float) -> None:
        g, hold = self._find(hid)
        held = hold.claim(hid, now) if hold is not None else None
        if held is None:
            if g is None:  # unknown here (released, expired, another board's): counted on the first generation
                g = next(iter(self.gens.serving_generations()), None)
            if g is not None:
                _count(g, "handoff_claims_refused")
            _send(self.sock, [ident, json.dumps({"t": "refused", "tid": key[1], "reason": "not held"}).encode()])
            return
        want = max(0, int(hdr.get("want", len(held.blocks))))
        credit = max(1, min(int(hdr.get("credit", DEFAULT_CREDIT)), 64))
        sums = hdr.get("sums")
        sums = tuple(s for s in sums if isinstance(s, str)) if isinstance(sums, list) else ()
        self._serves[key] = (Serve(key[1], hid, held.blocks[:want], now, credit=credit, timeout_s=self.timeout_s,
                                   sums=sums), g)
        _count(g, "handoff_claimed")

    def _release(self, hid: str, ok: bool) -> None:
        g, hold = self._find(hid)
        if hold is not None and hold.release(g.kv_tiers, hid):
            _count(g, "handoff_released")

    def pump(self, now: float) -> None:
        for key, (serve, g) in list(self._serves.items()):
            shell = g.kv_tiers
            before = serve.sent
            serve.pump(now, lambda c: _available(shell, c), lambda c: _read(shell, c))
            if serve.sent > before:
                _count(g, "handoff_served_blocks", serve.sent - before)
            for hdr, payload in serve.outbox:
                _send(self.sock, [key[0], json.dumps(hdr).encode()] + ([payload] if payload is not None else []))
            serve.outbox.clear()
            if serve.expired(now):  # ended, or the decode board went silent (killed): a claimed hold is
                del self._serves[key]  # never claimed again, so it is freed now rather than at its deadline
                self._release(serve.hid, False)

    def next_wakeup(self) -> float | None:
        """A serve waiting for an export job needs the loop to turn again soon."""
        return 0.005 if any(s.waiting for s, _ in self._serves.values()) else None

    def active(self) -> int:
        return len(self._serves)

    def close(self) -> None:
        self._serves.clear()
        self.sock.close(0)


def _available(shell, chain: bytes) -> bool | None:
    t = shell.tiers
    for tier in (t.host, t.disk):
        e = tier.entry(chain) if tier is not None else None
        if e is not None and e.state is EntryState.READY:
            return True
    d = t.disk.entry(chain) if t.disk is not None else None
    return False if d is not None else None  # PENDING: its export job is in flight


def _read(shell, chain: bytes) -> bytes | None:
    """The record of `chain` as it is stored: a host slot (shared memory) or the block file."""
    t = shell.tiers
    e = t.host.entry(chain) if t.host is not None else None
    if e is not None and e.state is EntryState.READY and shell.pool is not None:
        return shell.pool.raw(e.slot)
    e = t.disk.entry(chain) if t.disk is not None else None
    if e is not None and e.state is EntryState.READY and shell.disk_dir is not None:
        try:
            with open(block_file(shell.disk_dir, chain), "rb") as f:
                return f.read()
        except OSError:
            return None
    return None


def handoff_chains(tiers, params, handoff: dict) -> tuple[list, int]:
    """The chain hashes of a handed-off prompt's full blocks, and how many of the first this board has already
    (its own prefix, or an earlier hand-off): those need no copy."""
    bs = tiers.block_size
    tokens = params.prompt
    n_prompt = min(len(tokens), int(handoff.get("prompt_len") or 0)) or len(tokens)
    chains = chain_of(tiers.root(params.prefix_salt), tokens[:((n_prompt - 1) // bs) * bs], bs)
    have = 0
    for c in chains:
        if c not in tiers.disk and (tiers.host is None or c not in tiers.host):
            break
        have += 1
    return chains, have


def stage_records(shell, chains, records) -> int:
    """Write checked records into this board's disk tier (whole file or nothing under the name) and index
    them, in prompt order; the count staged (a full disk tier stops it: the rest is recomputed)."""
    disk = shell.tiers.disk
    staged = 0
    for chain, rec in zip(chains, records):
        if chain in disk:
            staged += 1
            continue
        path = block_file(shell.disk_dir, chain)
        tmp = f"{path}.{os.getpid()}.pull.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(rec)
            os.replace(tmp, path)
        except OSError:
            break
        if disk.adopt(chain) is None:  # the disk tier is full of pinned blocks: the rest is recomputed
            os.unlink(path)
            break
        staged += 1
    return staged


@dataclass
class _Parked:
    """A decode leg waiting for its pull; submitted when it ends, whichever way."""

    rid: int
    g: object
    params: object
    pull: Pull
    sock: zmq.Socket
    chains: list
    t0: float = 0.0


class TransferClient:
    """The decode side: pulls a descriptor's blocks before the request is submitted."""

    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, submit: Callable, client_keys=None,
                 timeout_s: float = 2.0, credit: int = DEFAULT_CREDIT, peer_dirs=()) -> None:
        self.ctx, self.poller, self.submit = ctx, poller, submit
        self.peer_dirs = tuple(peer_dirs)  # board.handoff_peer_dirs: a one-host hand-off needs no transfer
        self.client_keys = client_keys  # (public, secret) of this board for CURVE prefill boards, or None
        self.timeout_s, self.credit = timeout_s, credit
        self._by_sock: dict[zmq.Socket, _Parked] = {}
        self._by_rid: dict[int, _Parked] = {}

    def park(self, g, rid: int, handoff: dict, params, now: float) -> bool:
        """Start a pull for a decode leg when its descriptor names a transfer endpoint and this board can
        take the blocks (a disk tier of its own); False: the caller goes on as before."""
        endpoint = handoff.get("endpoint")
        shell = getattr(g, "kv_tiers", None)
        if not endpoint or handoff.get("export") or shell is None or shell.disk_dir is None:
            return False
        if handoff.get("curve_key") and self.client_keys is None:
            log("handoff_pull_skipped", endpoint=endpoint, reason="CURVE peer, no board.handoff_client_key")
            return False
        chains, have = handoff_chains(shell.tiers, params, handoff)
        if have == len(chains):
            return False  # nothing to pull (the scheduler finds it all here)
        first = chains[have].hex() + ".kv"
        if any(os.path.exists(os.path.join(d, shell.layout_hex, first)) for d in self.peer_dirs):
            return False  # the prefill board is on this host: its block files are linked (intake.py)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if handoff.get("curve_key"):
            sock.curve_publickey, sock.curve_secretkey = self.client_keys
            sock.curve_serverkey = handoff["curve_key"].encode()
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(0)
            return False
        layout = shell.layout

        def verify(i: int, rec: bytes) -> None:
            read_record(memoryview(rec), layout, chains[i])  # RecordRefused: another layout, prefix, torn

        pull = Pull(f"{os.getpid()}-{next(_tids)}", str(handoff["request"]), len(chains), now, credit=self.credit,
                    timeout_s=self.timeout_s, verify=verify)
        p = _Parked(rid, g, params, pull, sock, chains, now)
        self._by_sock[sock], self._by_rid[rid] = p, p
        self.poller.register(sock, zmq.POLLIN)
        self._flush(p)
        return True

    def owns(self, sock) -> bool:
        return sock in self._by_sock

    def parked(self, rid: int) -> bool:
        return rid in self._by_rid

    def on_readable(self, sock, now: float) -> None:
        p = self._by_sock.get(sock)
        if p is None:
            return
        while not p.pull.finished:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                hdr = json.loads(frames[0])
            except ValueError:
                p.pull.cancel("garbled")
                break
            p.pull.on_message(hdr, frames[1] if len(frames) > 1 else None, now)
        self._flush(p)
        if p.pull.finished:
            self._end(p, now)

    def pump(self, now: float) -> None:
        for p in list(self._by_rid.values()):
            p.pull.tick(now)
            if p.pull.finished:
                self._flush(p)
                self._end(p, now)

    def cancel(self, rid: int, now: float) -> bool:
        """A cancel (or a dead client) during the pull: the pull is given up and the request submitted, so
        the scheduler's cancel gives it its one terminal event."""
        p = self._by_rid.get(rid)
        if p is None:
            return False
        p.pull.cancel()
        self._flush(p)
        self._end(p, now)
        return True

    def next_wakeup(self) -> float | None:
        ds = [d for p in self._by_rid.values() if (d := p.pull.deadline()) is not None]
        return min(ds) if ds else None

    def _flush(self, p: _Parked) -> None:
        for hdr, payload in p.pull.outbox:
            _send(p.sock, [json.dumps(hdr).encode()] + ([payload] if payload is not None else []))
        p.pull.outbox.clear()

    def _end(self, p: _Parked, now: float) -> None:
        self._by_sock.pop(p.sock, None)
        self._by_rid.pop(p.rid, None)
        try:
            self.poller.unregister(p.sock)
        except KeyError:
            pass
        p.sock.close(0)  # linger 0: the release is on its way or the peer is gone (it expires the hold)
        g = p.g
        staged = self._stage(p) if p.pull.state is PullState.DONE else 0
        _count(g, "handoff_pull_us", round((now - p.t0) * 1e6))  # claim to staged (or given up): the transfer's cost
        if staged:
            _count(g, "handoff_imported")
            _count(g, "handoff_staged_blocks", staged)
            _count(g, "handoff_pulled_blocks", staged)
        else:
            _count(g, "handoff_recomputed")
            _count(g, "handoff_pull_failed")
            log("handoff_pull_failed", rid=p.rid, reason=p.pull.failure or "staging")
        self.submit(p.rid, g, p.params, now)

    def _stage(self, p: _Parked) -> int:
        return stage_records(p.g.kv_tiers, p.chains, p.pull.records)

    def close(self) -> None:
        for p in list(self._by_rid.values()):
            try:
                self.poller.unregister(p.sock)
            except KeyError:
                pass
            p.sock.close(0)
        self._by_sock.clear()
        self._by_rid.clear()

    def active(self) -> int:
        return len(self._by_rid)


class Transfers:
    """A board's two sides, as the loop sees them: sockets to poll, a pump per turn, a wake-up time."""

    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, cfg, gens, submit: Callable, security=None) -> None:
        b = cfg.board
        keys = None
        if b.handoff_client_key:
            from engine.daemon.curve import read_key_pair

            keys = read_key_pair(b.handoff_client_key)
        self.server = TransferServer(ctx, b.handoff_endpoint, gens, security, b.handoff_transfer_timeout_s) \
            if b.handoff_endpoint else None
        self.client = TransferClient(ctx, poller, submit, keys, b.handoff_transfer_timeout_s,
                                     peer_dirs=b.handoff_peer_dirs)
        self.poller = poller
        if self.server is not None:
            poller.register(self.server.sock, zmq.POLLIN)
            log("handoff_serving", endpoint=self.server.endpoint, curve=bool(self.server.curve_key))

    def owns(self, sock) -> bool:
        return (self.server is not None and sock is self.server.sock) or self.client.owns(sock)

    def on_readable(self, sock, now: float) -> None:
        if self.server is not None and sock is self.server.sock:
            self.server.on_readable(now)
        else:
            self.client.on_readable(sock, now)

    def pump(self, now: float) -> None:
        if self.server is not None:
            self.server.pump(now)
        self.client.pump(now)

    def next_wakeup(self, now: float) -> float | None:
        ds = [d for d in (self.client.next_wakeup(),
                          None if self.server is None or self.server.next_wakeup() is None
                          else now + self.server.next_wakeup()) if d is not None]
        return min(ds) if ds else None

    def stats(self) -> dict:
        return {"serving": 0 if self.server is None else self.server.active(), "pulling": self.client.active()}

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            try:
                self.poller.unregister(self.server.sock)
            except KeyError:
                pass
            self.server.close()
            self.server = None
