"""LoRA adapters through prefill/decode disaggregation: two real `ref` boards with the same adapters behind
a balancer, KV pulled over the transfer endpoint. The blocks are keyed by adapter on both boards (the
adapter's sha256 salts the chain hashes), so the decode board imports what the prefill board computed under
the same adapter, and each answer equals the co-located one."""

from __future__ import annotations

import os
import random

import pytest
from balancer_procs import tcp_daemon, tcp_endpoint
from raw_streams import gen_msg, run_streams, streamed_tokens
from test_balancer_disagg import check_one_done_each

from workers.lora.maker import make_lora
from workers.model_maker import make_model

pytestmark = pytest.mark.integration


def test_adapter_requests_hand_off_their_kv_and_answer_as_co_located(daemon, balancer, short_dir):
    base = make_model(os.path.join(short_dir, "base"), max_seq=512, kv_num_blocks=128, seed=8, golden_cases=1)
    loras = [f"a{i}={make_lora(base, os.path.join(short_dir, f'a{i}'), rank=4, seed=i)}" for i in range(2)]
    extra = ["--package", base] + [x for lo in loras for x in ("--lora", lo)]
    pk, dk = os.path.join(short_dir, "pk"), os.path.join(short_dir, "dk")
    p, ep = tcp_daemon(daemon, backend="ref", extra=extra,
                       settings={"board.role": "prefill", "kv.disk_dir": pk, "board.handoff_endpoint": tcp_endpoint(),
                                 "board.handoff_deadline_s": 60.0})
    d, ed = tcp_daemon(daemon, backend="ref", extra=extra,
                       settings={"board.role": "decode", "kv.disk_dir": dk, "kv.promote": "always",
                                 "board.handoff_transfer_timeout_s": 5.0})
    b = balancer(backends=[{"endpoint": ep, "role": "prefill"}, {"endpoint": ed, "role": "decode"}])
    rng = random.Random(5)
    shared = [rng.randrange(1, 250) for _ in range(64)]  # the same prompt under every adapter and the base
    msgs = [gen_msg(f"x{i}", shared + [i], max_tokens=6, ignore_eos=True,
                    **({} if i % 3 == 2 else {"adapter": f"a{i % 3}"})) for i in range(6)]
    got = run_streams(b.endpoint, msgs, grace=0.1)
    expected = run_streams(p.endpoint, msgs, grace=0.1)  # co-located, on the prefill board
    check_one_done_each(got, expected)
    answers = {tuple(streamed_tokens(expected[rid])) for rid in ("x0", "x1", "x2")}
    assert len(answers) == 3  # two adapters and the base: three different answers to one prompt
    with d.client() as c:
        dc = c.stats()["daemon"]
    assert dc["handoff_imported"] + dc["handoff_recomputed"] == len(msgs)
    assert dc["handoff_imported"] >= len(msgs) // 2 and dc["handoff_pulled_blocks"] > 0, dc
