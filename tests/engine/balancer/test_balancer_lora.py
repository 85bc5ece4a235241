"""`model: ADAPTER` and `adapter` through a balancer: two real `ref` boards on one base package, only one of
them with the adapter. The balancer learns each board's adapters from its heartbeats and sends every adapter
request to the board that has it; an adapter no board has is 404 `adapter_not_found`, as on a board."""

from __future__ import annotations

import os

import pytest
from balancer_procs import tcp_daemon
from raw_streams import gen_msg, run_streams, terminal_events

from waiting import wait_until
from workers.lora.maker import make_lora
from workers.model_maker import make_model

pytestmark = pytest.mark.integration


def test_adapter_requests_land_only_on_the_board_that_has_the_adapter(daemon, balancer, short_dir):
    base = make_model(os.path.join(short_dir, "base"), max_seq=256, kv_num_blocks=64, seed=8, golden_cases=1)
    lora = make_lora(base, os.path.join(short_dir, "sql"), rank=4, seed=1)
    with_it, ep1 = tcp_daemon(daemon, backend="ref", extra=["--package", base, "--lora", f"sql={lora}"])
    without, ep2 = tcp_daemon(daemon, backend="ref", extra=["--package", base])
    b = balancer(backends=[ep1, ep2])  # round-robin: base requests alternate between the two
    with b.client(timeout=10) as c:
        wait_until(lambda: "sql" in (c.health().get("adapters") or {}), 30, what="the balancer to learn the adapter")
        alias = c.health()["model"]["alias"]
    named = [{"model": "sql"}, {"adapter": "sql"}, {"adapter": "sql", "model": alias}]
    msgs = [gen_msg(f"a{i}", [256, 1 + i, 2, 3], max_tokens=3, ignore_eos=True, **named[i % 3]) for i in range(9)]
    msgs += [gen_msg(f"b{i}", [256, 9, i], max_tokens=3, ignore_eos=True) for i in range(4)]
    got = run_streams(b.endpoint, msgs, grace=0.1)
    ends = {rid: terminal_events(evs)[-1] for rid, evs in got.items()}
    assert all(e["ev"] == "done" for e in ends.values()), {r: e for r, e in ends.items() if e["ev"] != "done"}
    with with_it.client(timeout=10) as c:
        assert c.stats()["lora"]["adapters"]["sql"]["requests"] == 9
    with b.client(timeout=10) as c:  # the base requests went to both boards: only the adapter kept the others
        assert c.stats()["balancer"]["routed"][ep2] >= 1
    errs = run_streams(b.endpoint, [gen_msg("x", [256, 1], max_tokens=2, adapter="nope"),
                                    gen_msg("y", [256, 1], max_tokens=2, model="nope")], grace=0.1)
    assert [(e["code"], e["reason"]) for e in terminal_events(errs["x"])] == [(404, "adapter_not_found")]
    assert [(e["code"], e["reason"]) for e in terminal_events(errs["y"])] == [(404, "model_not_found")]
