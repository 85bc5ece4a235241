"""KV events: a real daemon publishes its prefix-cache changes over ZeroMQ PUB (engine/daemon/kv_events.py).

The wire is checked here against its description (vllm-router 0.1.17's reader); that the router really
routes on it is tests/engine/http/test_vllm_router.py::test_kv_aware_router_follows_what_each_board_holds.
"""

from __future__ import annotations

import socket
import struct
import time

import msgpack
import pytest
import zmq

from tools.load.ports import free_port
from engine.daemon.kv_events import block_hash, encode_message, events_of

BS = 16


def test_journal_entries_become_tagged_maps_with_every_key_the_router_requires():
    journal = [("stored", None, [(3, tuple(range(4))), (9, tuple(range(4, 8)))]),
               ("stored", 9, [(11, (8, 9, 10, 11))]), ("removed", [11, 3])]
    stored, below, removed = events_of(2, 4, journal)
    assert stored == {"type": "BlockStored", "block_hashes": [block_hash(2, 3), block_hash(2, 9)],
                      "parent_block_hash": None, "token_ids": list(range(8)), "block_size": 4,
                      "lora_id": None, "medium": None, "lora_name": None}
    assert below["parent_block_hash"] == block_hash(2, 9) and below["block_hashes"] == [block_hash(2, 11)]
    assert removed == {"type": "BlockRemoved", "block_hashes": [block_hash(2, 11), block_hash(2, 3)],
                       "medium": None}
    assert block_hash(0, 3) != block_hash(1, 3)  # two chips' block 3 are different blocks


def test_a_message_is_topic_seq_and_a_msgpack_batch():
    topic, seq, payload = encode_message(b"kv", 7, 12.5, [{"type": "AllBlocksCleared"}])
    assert topic == b"kv" and struct.unpack(">Q", seq) == (7,)
    assert msgpack.unpackb(payload) == [12.5, [{"type": "AllBlocksCleared"}]]


def receive(sub: zmq.Socket, until, timeout: float = 30.0) -> list[tuple[int, list[dict]]]:
    """(seq, events) messages until `until(messages)` holds."""
    got: list[tuple[int, list[dict]]] = []
    deadline = time.monotonic() + timeout
    while not until(got):
        left = deadline - time.monotonic()
        assert left > 0, f"no matching KV events within {timeout} s: {got}"
        if sub.poll(int(min(left, 0.2) * 1000)):  # short: `until` may act (send a request) while waiting
            topic, seq, payload = sub.recv_multipart()
            ts, events = msgpack.unpackb(payload)
            assert topic == b"board-kv" and abs(ts - time.time()) < 60
            got.append((struct.unpack(">Q", seq)[0], events))
    return got


@pytest.mark.integration
def test_daemon_publishes_the_blocks_a_prompt_fills_and_what_it_evicts(daemon):
    port = free_port()
    d = daemon(backend="stub", settings={"kv_events.endpoint": f"tcp://127.0.0.1:{port}",
                                         "kv_events.topic": "board-kv", "kv.num_blocks": 8})
    assert '"event":"kv_events_publishing"' in d.log()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        prompt = [(7 * i) % 300 for i in range(2 * BS + 5)]  # 2 full blocks and a partial one
        with d.client(timeout=30) as c:
            # PUB/SUB drops what is sent before the subscription is in place: prime with fresh prompts
            # until one message arrives
            primes = iter(range(1, 1000))

            def primed(msgs) -> bool:
                if not msgs:
                    c.generate([next(primes)] * BS, max_tokens=1)
                return bool(msgs)

            got = receive(sub, primed)
            c.generate(prompt, max_tokens=1)
            got += receive(sub, lambda m: any(e["type"] == "BlockStored" and e["token_ids"][:BS] == prompt[:BS]
                                              for _, evs in m for e in evs))
            seqs = [s for s, _ in got]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # consecutive: no gap
            stored = [e for _, evs in got for e in evs if e["type"] == "BlockStored"
                      and e["token_ids"][:BS] == prompt[:BS]]
            assert stored[0]["parent_block_hash"] is None and stored[0]["block_size"] == BS
            assert stored[0]["token_ids"] == prompt[: len(stored[0]["token_ids"])]
            assert len(stored[0]["token_ids"]) == BS * len(stored[0]["block_hashes"]) >= 2 * BS

            # 8 blocks per chip: unrelated prompts push the first one's blocks out, and the board says so
            mine = set(stored[0]["block_hashes"])
            for i in range(6):
                c.generate([(11 * i + 5 * j) % 300 for j in range(2 * BS)], max_tokens=1)
            gone = receive(sub, lambda m: mine & {h for _, evs in m for e in evs if e["type"] == "BlockRemoved"
                                                  for h in e["block_hashes"]})
            assert gone[0][0] == seqs[-1] + 1
    finally:
        sub.close(linger=0)
        ctx.term()


@pytest.mark.integration
def test_a_busy_kv_events_address_fails_startup_with_a_clear_message(daemon):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        d = daemon(backend="stub", settings={"kv_events.endpoint": f"tcp://127.0.0.1:{port}"}, wait=False)
        d.expect_exit = 1
        rc = d.proc.wait(60)
    log = d.log()
    assert rc == 1, log
    assert f"cannot publish KV events on tcp://127.0.0.1:{port}" in log and "kv_events.endpoint" in log
    assert '"event":"serving"' not in log


def test_the_publisher_follows_the_default_generation_and_clears_the_router_on_a_switch():
    """A replace moves the default model to a new generation: its caches are published from then on, the
    old ones are no longer journalled, and the router is told to forget what the old generation held."""
    from types import SimpleNamespace as NS

    from engine.daemon.kv_events import KvEventPublisher

    def generation():
        cache = NS(journal=None, block_size=4)
        return NS(scheduler=NS(chips={0: NS(kv=NS(cache=cache))})), cache

    old, old_cache = generation()
    new, new_cache = generation()
    ctx = zmq.Context()
    try:
        pub = KvEventPublisher(ctx, f"tcp://127.0.0.1:{free_port()}", "t", {0: old_cache}, owner=old)
        sent: list[list[str]] = []
        pub._send = lambda events: sent.append([e["type"] for e in events])
        assert old_cache.journal == [] and new_cache.journal is None
        pub.follow(old)  # the same generation: nothing happens
        assert sent == []
        pub.follow(new)
        assert old_cache.journal is None and new_cache.journal == [] and pub.owner is new
        new_cache.journal.append(("stored", None, [(1, (1, 2, 3, 4))]))
        old_cache.journal = [("stored", None, [(2, (5, 6, 7, 8))])]  # the old generation's: not published
        pub.flush()
        assert sent == [["AllBlocksCleared"], ["BlockStored"]]
        pub.close()
    finally:
        ctx.term()
