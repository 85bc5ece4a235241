"""Routing through a real balancer: the prefix policy against round-robin on a shared-prefix workload,
and a SIGHUP reload of the backend list under load."""

from __future__ import annotations

import random
import signal
import time

import pytest
from balancer_procs import tcp_daemon, write_config
from raw_streams import gen_msg, run_streams, streamed_tokens, terminal_events

pytestmark = pytest.mark.integration


def shared_prefix_workload(tag: int, groups: int = 5, per_group: int = 6, prefix_len: int = 128) -> list[list[int]]:
    """Requests in rounds over `groups` long prefixes, each with its own short suffix (odd `groups`: plain
    round-robin over two backends sends each prefix to both)."""
    rngs = [random.Random(tag * 100 + g) for g in range(groups)]
    prefixes = [[rng.randrange(1, 250) for _ in range(prefix_len)] for rng in rngs]
    return [prefixes[g] + [(r * 7 + g) % 200 + 1, r + 1] for r in range(per_group) for g in range(groups)]


def prefix_hits(clients) -> int:
    return sum(c.stats()["scheduler"]["counters"].get("prefix_hit_tokens", 0) for c in clients)


def test_prefix_policy_reaches_a_higher_prefix_hit_rate_than_round_robin(daemon, balancer):
    daemons = [tcp_daemon(daemon, backend="stub") for _ in range(2)]
    rates = {}
    for tag, policy in enumerate(("round-robin", "prefix")):
        b = balancer(backends=[e for _, e in daemons], policy=policy)
        clients = [d.client(timeout=10) for d, _ in daemons]
        try:
            before = prefix_hits(clients)
            prompts = shared_prefix_workload(tag)
            with b.client(timeout=30) as c:
                for p in prompts:
                    c.generate(p, max_tokens=4)
            rates[policy] = (prefix_hits(clients) - before) / sum(len(p) for p in prompts)
        finally:
            for c in clients:
                c.close()
        b.stop()
    print(f"daemon-side prefix hit rate: {rates}")
    assert rates["prefix"] > rates["round-robin"], rates


def test_sighup_reload_swaps_backends_without_dropping_streams(daemon, balancer, short_dir):
    opts = {"decode_base_ms": 5.0}
    (d1, e1), (d2, e2) = (tcp_daemon(daemon, backend="sim", backend_options=opts) for _ in range(2))
    b = balancer(backends=[e1])
    good = open(b.config_path).read()
    with open(b.config_path, "a") as fh:
        fh.write("nonsense_key = 1\n")
    b.proc.send_signal(signal.SIGHUP)  # a broken file: logged, the running configuration stays
    deadline = time.monotonic() + 10
    while "reload_failed" not in b.log():
        assert time.monotonic() < deadline and b.proc.poll() is None, b.log()[-2000:]
        time.sleep(0.05)
    assert [x["endpoint"] for x in b.health()["balancer"]["backends"]] == [e1]
    with open(b.config_path, "w") as fh:
        fh.write(good)
    msgs = [gen_msg(f"h{i}", [4, 5, 6], max_tokens=200, seed=i, ignore_eos=True) for i in range(3)]
    seen = {}

    def reload_mid_stream(events, sock):
        if "hup" not in seen and all(len(streamed_tokens(events.get(m["id"], []))) >= 3 for m in msgs):
            write_config(b.config_path, endpoint=b.endpoint, backends=[e2])
            b.proc.send_signal(signal.SIGHUP)
            seen["hup"] = time.monotonic()

    got = run_streams(b.endpoint, msgs, on_progress=reload_mid_stream)
    for m in msgs:
        (t,) = terminal_events(got[m["id"]])
        assert t["ev"] == "done" and len(streamed_tokens(got[m["id"]])) == 200
    deadline = time.monotonic() + 10
    while [x["endpoint"] for x in b.health()["balancer"]["backends"]] != [e2]:
        assert time.monotonic() < deadline, b.health()
        time.sleep(0.05)
    b.wait_backends_up(1)
    with b.client(timeout=10) as c:
        for _ in range(3):
            c.generate([1, 2], max_tokens=2)
        assert c.stats()["balancer"]["routed"] == {e1: 3, e2: 3}
