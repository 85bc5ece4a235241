"""The board's prefix-cache changes as KV events over ZeroMQ PUB, for `vllm-router --policy kv_aware`.

With `[kv_events] endpoint` set, the daemon turns on each chip's `PrefixCache.journal` and, once per loop
turn, publishes what changed, so a cluster router routes on what the board really holds (evictions
included) instead of guessing from what it sent there. The wire is what vllm-router 0.1.17 reads (vLLM's
`ZmqEventPublisher` framing; docs/cluster.md): a multipart message `[topic, seq (u64 big-endian),
msgpack([ts, [event, ...]])]`, each event a map tagged by "type":

* `BlockStored`: `block_hashes`, `parent_block_hash`, `token_ids` (the blocks' tokens, concatenated),
  `block_size`, and `lora_id`, `medium`, `lora_name` (nil here, but the router requires the keys);
* `BlockRemoved`: `block_hashes`, `medium`;
* `AllBlocksCleared`: sent at start, so a router that knew an earlier run of this board forgets it, and
  whenever the board's default model moves to another generation (a replace or rollback: the events follow
  the generation that serves requests without `model`, whose caches start empty).

A block's hash is opaque to the router (it hashes `token_ids` itself; the hash only chains parents and
names removals): `chip << 32 | block id`. `seq` counts messages from 0; a router that sees a gap (a
dropped message, a restarted board) drops everything it knew of the board. Nothing is replayed.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Mapping

import msgpack
import zmq

from engine.core.kv.prefix_cache import PrefixCache


def prefix_caches(scheduler) -> dict[int, PrefixCache]:
    """Each chip's prefix cache in the scheduler core (the journals live there)."""
    return {chip: state.kv.cache for chip, state in scheduler.chips.items()}


def block_hash(chip: int, block: int) -> int:
    return chip << 32 | block


def events_of(chip: int, block_size: int, journal: list[tuple]) -> list[dict]:
    """The KV events for one chip's journal entries (see `PrefixCache.journal`)."""
    out = []
    for entry in journal:
        if entry[0] == "stored":
            _, parent, chain = entry
            out.append({"type": "BlockStored",
                        "block_hashes": [block_hash(chip, b) for b, _ in chain],
                        "parent_block_hash": None if parent is None else block_hash(chip, parent),
                        "token_ids": [t for _, edge in chain for t in edge],
                        "block_size": block_size, "lora_id": None, "medium": None, "lora_name": None})
        else:
            assert entry[0] == "removed", entry
            out.append({"type": "BlockRemoved", "block_hashes": [block_hash(chip, b) for b in entry[1]],
                        "medium": None})
    return out


def encode_message(topic: bytes, seq: int, ts: float, events: list[dict]) -> list[bytes]:
    return [topic, struct.pack(">Q", seq), msgpack.packb([ts, events], use_bin_type=True)]


class KvEventPublisher:
    """The PUB socket and the chips' journals. `flush()` once per loop turn; `close()` at shutdown."""

    def __init__(self, ctx: zmq.Context, endpoint: str, topic: str, caches: Mapping[int, PrefixCache],
                 wall_clock: Callable[[], float] = time.time, owner: object = None) -> None:
        self.topic = topic.encode()
        self.caches = dict(caches)
        self.wall_clock = wall_clock
        self.seq = 0
        self.sent_events = 0
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError:
            self.sock.close()
            raise
        self.owner = owner  # the generation whose caches these are
        for cache in self.caches.values():
            cache.journal = []
        self._send([{"type": "AllBlocksCleared"}])

    def follow(self, generation) -> None:
        """Publish for `generation` (the board's default) from now on, if that is another one."""
        if generation is self.owner or generation is None or generation.scheduler is None:
            return
        for cache in self.caches.values():
            cache.journal = None
        self.owner, self.caches = generation, prefix_caches(generation.scheduler)
        for cache in self.caches.values():
            cache.journal = []
        self._send([{"type": "AllBlocksCleared"}])

    def flush(self) -> None:
        events: list[dict] = []
        for chip, cache in self.caches.items():
            if cache.journal:
                events += events_of(chip, cache.block_size, cache.journal)
                cache.journal.clear()
        if events:
            self._send(events)

    def _send(self, events: list[dict]) -> None:
        # a PUB socket never blocks: with no subscriber, or one too slow, messages are dropped (the
        # router then sees a seq gap and forgets the board's blocks, which is the safe direction)
        self.sock.send_multipart(encode_message(self.topic, self.seq, self.wall_clock(), events))
        self.seq += 1
        self.sent_events += len(events)

    def close(self) -> None:
        for cache in self.caches.values():
            cache.journal = None
        self.sock.close(linger=0)
