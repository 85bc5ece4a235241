"""Four board daemons behind two balancers behind a third, every tcp:// hop with CURVE.

Every stream is correct through two levels, cancel reaches the daemon, stats
aggregate over the tree, tenants come from the client keys (and one tenant
cannot cancel another's request), and unknown or missing keys are refused.
"""

from __future__ import annotations

import os
import shutil
import stat
import time

import pytest
from balancer_procs import tcp_daemon
from raw_streams import gen_msg, run_streams, streamed_tokens, terminal_events

from engine.daemon.curve import client_keys
from engine.errors import ClientTimeout, Forbidden
from tools import keygen_cmd

pytestmark = pytest.mark.integration


@pytest.fixture
def keys(short_dir):
    d = os.path.join(short_dir, "keys")
    for name in ("board", "l1srv", "l2srv", "bal-l1", "bal-l2", "alice", "bob", "ops", "mallory"):
        assert keygen_cmd.main([d, name]) == 0
    assert keygen_cmd.main([d, "alice"]) == 1  # never overwrites a pair
    for f in os.listdir(d):
        assert stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode) == 0o600

    def allow(name, members):
        p = os.path.join(short_dir, name)
        os.makedirs(p)
        for m in members:
            shutil.copy(os.path.join(d, m + ".key"), p)
        return p

    return {"dir": d, "daemon_allow": allow("allow-d", ["bal-l1"]),
            "l1_allow": allow("allow-l1", ["bal-l2", "alice", "bob", "ops"]),
            "l2_allow": allow("allow-l2", ["alice", "bob", "ops"]),
            "secret": lambda n: os.path.join(d, n + ".key_secret"), "public": lambda n: os.path.join(d, n + ".key")}


LONG = 60_000  # tokens: two minutes at 2 ms a step, far past anything the test waits for before cancelling


def security_toml(keys, server: str, allow: str, client: str) -> str:
    return (f'[security]\nserver_secret_key = "{keys["secret"](server)}"\nclient_keys_dir = "{allow}"\n'
            f'admins = ["ops"]\nforwarders = ["bal-l2"]\nclient_secret_key = "{keys["secret"](client)}"\n')


def test_two_level_balancers_with_curve(daemon, balancer, keys):
    sec = {"security.server_secret_key": keys["secret"]("board"), "security.client_keys_dir": keys["daemon_allow"],
           "security.forwarders": ["bal-l1"]}
    # max_seq: room for a stream that is effectively unbounded (it ends when it is cancelled)
    daemons = [tcp_daemon(daemon, backend="sim", settings=sec, backend_options={"decode_base_ms": 2.0,
                                                                                "max_seq": 65536})
               for _ in range(4)]
    board_key = keys["public"]("board")
    as_alice_l1 = client_keys(keys["secret"]("alice"), keys["public"]("l1srv"))
    # one balancer over all four daemons, a second over two of them, a third in front of both
    l1 = [balancer(backends=[{"endpoint": e, "server_key": board_key} for _, e in group],
                   policy="least-load", extra_toml=security_toml(keys, "l1srv", keys["l1_allow"], "bal-l1"),
                   health_kw={"curve": as_alice_l1})
          for group in (daemons, daemons[2:])]
    l2 = balancer(backends=[{"endpoint": b.endpoint, "server_key": keys["public"]("l1srv")} for b in l1],
                  policy="round-robin", extra_toml=security_toml(keys, "l2srv", keys["l2_allow"], "bal-l2"),
                  health_kw={"curve": client_keys(keys["secret"]("alice"), keys["public"]("l2srv"))})
    as_ = {n: client_keys(keys["secret"](n), keys["public"]("l2srv")) for n in ("alice", "bob", "ops", "mallory")}

    def with_key(name):
        k = as_[name]

        def setup(sock):
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = k.public, k.secret, k.server_public
        return setup

    # every stream correct through two levels (alice claims tenant "bob": the key decides)
    msgs = [gen_msg(f"a{i}", [3 + i, 4, 5], max_tokens=40, seed=i, tenant="bob") for i in range(8)]
    got = run_streams(l2.endpoint, msgs, setup=with_key("alice"))
    direct = run_streams(daemons[0][0].endpoint, [{k: v for k, v in m.items() if k != "tenant"} for m in msgs])

    def alice_l1(sock):
        sock.curve_publickey, sock.curve_secretkey = as_alice_l1.public, as_alice_l1.secret
        sock.curve_serverkey = as_alice_l1.server_public

    one_level = run_streams(l1[0].endpoint, msgs, setup=alice_l1)
    for m in msgs:
        for run in (got, one_level):
            assert len(terminal_events(run[m["id"]])) == 1
            assert streamed_tokens(run[m["id"]]) == streamed_tokens(direct[m["id"]])
    with l1[0].client(timeout=10, curve=as_alice_l1) as c:
        routed = c.stats()["balancer"]["routed"]
    assert len(routed) == 4, routed  # least-load spread the concurrent streams over all four daemons

    # cancel reaches the daemon where the request lives; bob cannot cancel alice's id
    seen = {}

    def cancel_soon(events, sock):
        if "c" not in seen and len(streamed_tokens(events.get("long", []))) >= 3:
            from ipc.codec import encode
            from engine.client import Client

            with Client(l2.endpoint, timeout=5, curve=as_["bob"]) as bob:
                bob.cancel("other")  # bob's own connection: these ids are not his
                bob.cancel("long")
            time.sleep(0.3)
            seen["bob_done"] = any(e["ev"] == "done" for e in events.get("long", []))
            sock.send(encode({"v": 1, "op": "cancel", "id": "long"}))
            seen["c"] = True

    long_ = [gen_msg("long", [1, 2], max_tokens=LONG, ignore_eos=True),
             gen_msg("other", [1, 2], max_tokens=60, seed=9)]
    got = run_streams(l2.endpoint, long_, setup=with_key("alice"), on_progress=cancel_soon)
    (t,) = terminal_events(got["long"])
    assert t["ev"] == "done" and t["finish_reason"] == "cancelled" and not seen["bob_done"]
    assert t["usage"]["completion_tokens"] < LONG
    (o,) = terminal_events(got["other"])
    assert o["finish_reason"] == "length" and len(streamed_tokens(got["other"])) == 60

    with l2.client(timeout=10, curve=as_["alice"]) as c:
        st = c.stats()
        h = c.health()
        with pytest.raises(Forbidden):
            c.call("drain", backend=l1[0].endpoint)
    assert h["ok"] and h["backends_up"] == 2 and h["chips_up"] >= 4
    assert set(st["backends"]) == {b.endpoint for b in l1}
    total = st["total"]
    assert total["frontend"]["requests"] >= 10  # every generate reached some daemon, summed over four
    assert total["scheduler"]["counters"]["cancelled"] >= 1
    assert "alice" in total["scheduler"]["tenant_service_tokens"]
    assert "bob" not in total["scheduler"]["tenant_service_tokens"]
    with l2.client(timeout=10, curve=as_["bob"]) as c:  # bob sees no other tenant in the stats
        assert c.stats()["total"]["scheduler"]["tenant_service_tokens"] == {}
    with l2.client(timeout=10, curve=as_["ops"]) as c:
        assert c.call("drain", backend=l1[0].endpoint) == {"backend": l1[0].endpoint, "drained": True}
        for _ in range(3):
            c.generate([1], max_tokens=2)
        assert c.stats()["balancer"]["routed"].get(l1[0].endpoint, 0) == \
            st["balancer"]["routed"].get(l1[0].endpoint, 0)
        c.call("resume", backend=l1[0].endpoint)

    # refused: no key, an unknown key; a client key the daemons do not list
    from engine.client import Client

    for curve in (None, as_["mallory"]):
        with Client(l2.endpoint, timeout=1.5, curve=curve) as c, pytest.raises(ClientTimeout):
            c.health()
    with Client(daemons[0][1], timeout=1.5, curve=client_keys(keys["secret"]("alice"), board_key)) as c, \
            pytest.raises(ClientTimeout):
        c.health()
