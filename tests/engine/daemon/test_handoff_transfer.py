"""The transfer shell over real zmq in one process: a served hold pulled over tcp with CURVE, and refusals.

Fake generations (a disk tier index, block files in a temporary dir) stand in for two boards; the
daemon's loop is replaced by polling both sides' sockets by hand.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np
import zmq
import zmq.auth

from engine.core.kv.chain_hash import chain_of
from engine.core.tier_transfers import KvTiers
from engine.daemon.curve import CurveSetup
from engine.daemon.handoff.hold import HandoffHold
from engine.daemon.handoff.transfer import TransferClient, TransferServer
from ipc.kv_slots import encode_record
from workers.kv_transfer import block_file

BS, LAYOUT = 4, 0x1234


def board(tmp, name):
    d = os.path.join(tmp, name)
    os.makedirs(d)
    shell = SimpleNamespace(tiers=KvTiers("tag", BS, disk_blocks=64), disk_dir=d, pool=None, layout=LAYOUT,
                            layout_hex=f"{LAYOUT:016x}")
    return SimpleNamespace(kv_tiers=shell, handoff_hold=HandoffHold(30.0), counters={}, scheduler=object())


def export(g, prompt):
    """What a prefill board's write-through leaves: READY disk entries and their block files."""
    sh = g.kv_tiers
    chains = chain_of(sh.tiers.root(""), prompt[:((len(prompt) - 1) // BS) * BS], BS)
    for i, c in enumerate(chains):
        with open(block_file(sh.disk_dir, c), "wb") as f:
            f.write(encode_record(LAYOUT, np.full(8, i, np.uint8), c))
        sh.tiers.disk.filled(sh.tiers.disk.claim(c), True)
    return chains


def turn(srv, cli, poller, until):
    deadline = time.monotonic() + 10
    while not until() and time.monotonic() < deadline:
        now = time.monotonic()
        for s, _ in poller.poll(10):
            if s is srv.sock:
                srv.on_readable(now)
            else:
                cli.on_readable(s, now)
        srv.pump(now)
        cli.pump(now)


def keys(tmp):
    d = os.path.join(tmp, "keys")
    os.makedirs(os.path.join(d, "allowed"))
    zmq.auth.create_certificates(d, "server")
    zmq.auth.create_certificates(d, "decode")
    os.rename(os.path.join(d, "decode.key"), os.path.join(d, "allowed", "decode.key"))
    return d


def test_pull_a_held_hand_off_over_curve_tcp_and_release_it(tmp_path):
    tmp = str(tmp_path)
    kd = keys(tmp)
    ctx = zmq.Context()
    sec = CurveSetup(ctx, server_secret_key=os.path.join(kd, "server.key_secret"),
                     client_keys_dir=os.path.join(kd, "allowed"))
    try:
        pg, dg = board(tmp, "p"), board(tmp, "d")
        prompt = list(range(1, 80))  # 19 full blocks before the last token: two chunks
        chains = export(pg, prompt)
        assert pg.handoff_hold.hold(pg.kv_tiers, "r1", prompt, "", time.monotonic()) == len(chains) == 19
        gens = SimpleNamespace(serving_generations=lambda: [pg])
        srv = TransferServer(ctx, "tcp://127.0.0.1:0", gens, sec)
        desc = {"board": "p", "request": "r1", "prompt_len": len(prompt), **srv.descriptor_fields()}
        assert desc["endpoint"].startswith("tcp://127.0.0.1:") and len(desc["curve_key"]) == 40
        poller = zmq.Poller()
        poller.register(srv.sock, zmq.POLLIN)
        submitted = []
        cli = TransferClient(ctx, poller, lambda rid, g, params, now: submitted.append(rid),
                             zmq.auth.load_certificate(os.path.join(kd, "decode.key_secret")))
        params = SimpleNamespace(prompt=prompt, prefix_salt="")
        assert cli.park(dg, 7, desc, params, time.monotonic())
        turn(srv, cli, poller, lambda: submitted)
        assert submitted == [7]
        assert dg.counters["handoff_imported"] == 1 and dg.counters["handoff_pulled_blocks"] == 19
        assert all(c in dg.kv_tiers.tiers.disk for c in chains)
        for c in chains:  # the records, byte for byte, in the decode board's own disk tier
            with open(block_file(dg.kv_tiers.disk_dir, c), "rb") as a, open(block_file(pg.kv_tiers.disk_dir, c),
                                                                             "rb") as b:
                assert a.read() == b.read()
        turn(srv, cli, poller, lambda: pg.counters.get("handoff_released"))
        assert pg.counters["handoff_released"] == 1 and len(pg.handoff_hold.table) == 0
        assert pg.handoff_hold.pinned_blocks() == 0 and srv.active() == 0 and cli.active() == 0
        # a second claim of the same hand-off is refused: recomputed, never imported twice
        dg2 = board(tmp, "d2")
        assert cli.park(dg2, 8, desc, params, time.monotonic())
        turn(srv, cli, poller, lambda: 8 in submitted)
        assert dg2.counters["handoff_recomputed"] == 1 and pg.counters["handoff_claims_refused"] == 1
        srv.close()
        cli.close()
    finally:
        sec.stop()
        ctx.destroy(linger=0)


def test_a_pull_without_a_client_key_to_a_curve_board_is_not_started(tmp_path):
    ctx = zmq.Context()
    try:
        dg = board(str(tmp_path), "d")
        cli = TransferClient(ctx, zmq.Poller(), lambda *a: None)
        desc = {"board": "p", "request": "r1", "prompt_len": 20, "endpoint": "tcp://127.0.0.1:1",
                "curve_key": "x" * 40}
        assert not cli.park(dg, 1, desc, SimpleNamespace(prompt=list(range(20)), prefix_salt=""), 0.0)
    finally:
        ctx.destroy(linger=0)


def test_the_descriptor_carries_the_transfer_endpoint_on_the_wire_and_through_a_router():
    import pytest

    from engine.http import kv_transfer
    from ipc.schema import ProtocolError, validate_request

    desc = {"board": "0", "request": "r3", "prompt_len": 40, "endpoint": "tcp://10.0.0.2:7101", "curve_key": "k" * 40}
    msg = validate_request({"v": 1, "op": "generate", "id": "a", "prompt": [1, 2], "handoff": desc})
    assert msg["handoff"]["endpoint"] == desc["endpoint"] and msg["handoff"]["curve_key"] == "k" * 40
    for bad in ({"endpoint": "http://x"}, {"curve_key": "short"}):
        with pytest.raises(ProtocolError):
            validate_request({"v": 1, "op": "generate", "id": "a", "prompt": [1, 2], "handoff": {**desc, **bad}})
    # vllm-router carries our descriptor in kv_transfer_params: the endpoint survives, a mangled one is dropped
    params = kv_transfer.response_params({"handoff": desc, "usage": {"prompt_tokens": 40}}, "w", "board-0")
    assert kv_transfer.handoff_of(params)["endpoint"] == desc["endpoint"]
    params[kv_transfer.OURS] = {**desc, "endpoint": "file:///etc/passwd"}
    assert "endpoint" not in kv_transfer.handoff_of(params)
