"""Prefill/decode disaggregation through a real balancer and real `ref` boards.

One prefill board and one decode board behind `npuserve balance` (roles in its [[backends]]): the
disaggregated outputs equal a co-located run (the oracle: the decode board serving each request whole),
greedy and sampled, short and long prompts, with prefix hits on either side (and with
`routing.pd_min_prompt_tokens`, the short ones served whole by the decode board); faults (the prefill board
killed after it answered, the decode board killed mid-stream, a cancel during the hand-off) give every
request one terminal event and leave both boards' pools and the balancer empty. Without a KV path between
the boards (no `board.handoff_peer_dirs`), every hand-off recomputes the prompt on the decode board (its
counters say so); that is the fallback the tests pin where they set no such path.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from balancer_procs import tcp_daemon
from raw_streams import gen_msg, run_streams, streamed_tokens, terminal_events

from waiting import wait_until

pytestmark = pytest.mark.integration


def seeded_requests(n: int, seed: int = 27, max_tokens: int = 12) -> list[dict]:
    """Short and long prompts, some sharing a long prefix (prefix hits), greedy and sampled."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 250) for _ in range(48)]
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(2, 8))]
        elif kind == 1:
            prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(60, 120))]
        else:
            prompt = shared + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 20))]
        sampled = i % 2 == 1
        out.append(gen_msg(f"q{i}", prompt, max_tokens=max_tokens, ignore_eos=bool(i % 3),
                           temperature=0.8 if sampled else 0.0, seed=1000 + i, top_k=0 if i % 5 else 40))
    return out


def daemon_counters(d) -> dict:
    with d.client() as c:
        return c.stats()["daemon"]


def _active_requests(d) -> int:
    with d.client(timeout=30) as c:
        return c.health()["active_requests"]


def kv_used_blocks(d) -> int:
    with d.client() as c:
        st = c.stats()["scheduler"]
    return sum(ch["kv"]["blocks"]["used"] for ch in st["chips"].values())


@pytest.fixture
def pd_pair(daemon, balancer):
    (p, ep), (dd, ed) = (tcp_daemon(daemon, backend="ref", settings={"board.role": "prefill"}),
                         tcp_daemon(daemon, backend="ref", settings={"board.role": "decode"}))
    b = balancer(backends=[{"endpoint": ep, "role": "prefill"}, {"endpoint": ed, "role": "decode"}],
                 policy="prefix")
    return p, dd, b


def check_one_done_each(got: dict, expected: dict) -> None:
    for rid, evs in expected.items():
        terms = terminal_events(got[rid])
        assert len(terms) == 1, (rid, [e["ev"] for e in got[rid]][-5:])
        assert terms[0]["ev"] == "done", terms[0]
        assert streamed_tokens(got[rid]) == streamed_tokens(evs), rid


def test_disaggregated_outputs_equal_co_located(pd_pair):
    p, d, b = pd_pair
    msgs = seeded_requests(100)
    expected = run_streams(d.endpoint, msgs, grace=0.1)  # the oracle: co-located on one board
    got = run_streams(b.endpoint, msgs, grace=0.1)
    check_one_done_each(got, expected)
    for m in msgs:
        (fin,) = terminal_events(got[m["id"]])
        assert fin["usage"]["prompt_tokens"] == len(m["prompt"])  # the prompt counted once
        # counted as the board alone counts: the ids sent and an EOS or stop id generated but not sent
        assert fin["usage"]["completion_tokens"] == terminal_events(expected[m["id"]])[0]["usage"]["completion_tokens"]
    pc, dc = daemon_counters(p), daemon_counters(d)
    with b.client() as c:
        bal = c.stats()["balancer"]["counters"]
    assert pc["handoff_exports"] == bal["pd_handoffs"] > 0
    assert dc["handoff_recomputed"] == bal["pd_handoffs"] and dc["handoff_imported"] == 0
    wait_until(lambda: kv_used_blocks(p) == 0 and kv_used_blocks(d) == 0, what="pools at baseline")


def test_prompts_under_pd_min_prompt_tokens_go_whole_to_the_decode_board(daemon, balancer):
    """routing.pd_min_prompt_tokens through a real balancer: the short prompts are served whole by the decode
    board (no prefill leg, no hand-off), the long ones in two legs; every output is the co-located run's."""
    (p, ep), (d, ed) = (tcp_daemon(daemon, backend="ref", settings={"board.role": "prefill"}),
                        tcp_daemon(daemon, backend="ref", settings={"board.role": "decode"}))
    b = balancer(backends=[{"endpoint": ep, "role": "prefill"}, {"endpoint": ed, "role": "decode"}],
                 policy="least-load", extra_toml="[routing]\npd_min_prompt_tokens = 32")
    rng = random.Random(11)
    lens = [5, 60, 31, 32, 8, 90]  # 3 shorter than 32, 3 of 32 and more
    msgs = [gen_msg(f"m{i}", [rng.randrange(1, 250) for _ in range(n)], max_tokens=6, ignore_eos=True,
                    temperature=0.8 if i % 2 else 0.0, seed=70 + i) for i, n in enumerate(lens)]
    expected = run_streams(d.endpoint, msgs, grace=0.1)
    exported = daemon_counters(p)["handoff_exports"]
    got = run_streams(b.endpoint, msgs, grace=0.1)
    check_one_done_each(got, expected)
    with b.client() as c:
        bal = c.stats()["balancer"]["counters"]
    assert bal["pd_handoffs"] == 3 and daemon_counters(p)["handoff_exports"] - exported == 3
    assert daemon_counters(d)["handoff_recomputed"] == 3  # the decode legs (no KV path between these boards)


def test_faults_end_every_request_once_and_free_both_pools(daemon, balancer):
    (p, ep), (d1, e1), (d2, e2) = (tcp_daemon(daemon, backend="ref", settings={"board.role": "prefill"}),
                                   tcp_daemon(daemon, backend="ref", settings={"board.role": "decode"}),
                                   tcp_daemon(daemon, backend="ref", settings={"board.role": "decode"}))
    b = balancer(backends=[{"endpoint": ep, "role": "prefill"}, {"endpoint": e1, "role": "decode"},
                           {"endpoint": e2, "role": "decode"}], policy="least-load")
    msgs = [gen_msg(f"r{i}", [10 + i, 20, 30, 40, 50], max_tokens=150, temperature=0.9 if i % 2 else 0.0,
                    seed=7 + i, ignore_eos=True) for i in range(6)]
    cancelled = gen_msg("c0", [99, 98, 97], max_tokens=150, ignore_eos=True)
    expected = run_streams(d2.endpoint, msgs)
    p.expect_exit = None
    seen: dict = {}
    boards = {"d1": d1, "d2": d2}

    def faults(events, sock):
        from ipc.codec import encode
        if "cancel" not in seen and streamed_tokens(events.get("c0", [])):
            sock.send(encode({"v": 1, "op": "cancel", "id": "c0"}))  # right after the prefill leg's token
            seen["cancel"] = time.monotonic()
        if "p" not in seen and all(len(streamed_tokens(events.get(m["id"], []))) >= 3 for m in msgs):
            os.kill(p.pid, signal.SIGKILL)  # every request has left the prefill board
            seen["p"] = time.monotonic()
        if "p" in seen and "d1" not in seen and all(len(streamed_tokens(events.get(m["id"], []))) >= 30
                                                    for m in msgs):
            # mid-stream, the decode board that holds streams (least-load may have sent them all to one board):
            # its streams migrate to the other
            name = max(boards, key=lambda n: _active_requests(boards[n]))
            victim = boards.pop(name)
            victim.expect_exit = None
            os.kill(victim.pid, signal.SIGKILL)
            seen["d1"] = time.monotonic()

    got = run_streams(b.endpoint, msgs + [cancelled], on_progress=faults)
    assert set(seen) == {"cancel", "p", "d1"}, seen
    check_one_done_each(got, expected)
    (term,) = terminal_events(got["c0"])
    assert term["ev"] == "done" and term["finish_reason"] == "cancelled"
    with b.client() as c:
        st = c.stats()["balancer"]
    assert st["active_requests"] == 0 and st["counters"]["migrations"] >= 1
    (survivor,) = boards.values()
    wait_until(lambda: kv_used_blocks(survivor) == 0, what="the surviving decode pool at baseline")
    # a request after the prefill board died goes whole to a decode board (no request lost to a role)
    got = run_streams(b.endpoint, [gen_msg("late", [1, 2, 3], max_tokens=4)], timeout=60)
    (term,) = terminal_events(got["late"])
    assert term["ev"] == "done" and len(streamed_tokens(got["late"])) == 4


def test_the_decode_board_imports_the_prefill_boards_blocks_through_the_disk_tier(daemon, balancer, short_dir):
    """Both boards on one host with disk KV tiers: the decode board finds the prompt's blocks in the prefill
    board's kv.disk_dir (board.handoff_peer_dirs) by chain hash and imports them instead of computing them;
    outputs stay those of a co-located run (the prefill board serving each request whole, afterwards)."""
    pk, dk = os.path.join(short_dir, "pk"), os.path.join(short_dir, "dk")
    (p, ep) = tcp_daemon(daemon, backend="ref", settings={"board.role": "prefill", "kv.disk_dir": pk,
                                                          "board.handoff_deadline_s": 1.0,
                                                          "recovery.supervise_interval_ms": 100})
    (d, ed) = tcp_daemon(daemon, backend="ref", settings={"board.role": "decode", "kv.disk_dir": dk,
                                                          "kv.promote": "always", "board.handoff_peer_dirs": [pk]})
    b = balancer(backends=[{"endpoint": ep, "role": "prefill"}, {"endpoint": ed, "role": "decode"}])
    rng = random.Random(5)
    msgs = [gen_msg(f"k{i}", [rng.randrange(1, 250) for _ in range(rng.randrange(40, 110))], max_tokens=10,
                    temperature=0.8 if i % 2 else 0.0, seed=50 + i, ignore_eos=True) for i in range(16)]
    got = run_streams(b.endpoint, msgs, grace=0.1)
    expected = run_streams(p.endpoint, msgs, grace=0.1)
    check_one_done_each(got, expected)
    with d.client() as c:
        st = c.stats()
    dc, counters = st["daemon"], st["scheduler"]["counters"]
    assert dc["handoff_imported"] + dc["handoff_recomputed"] == len(msgs)
    assert dc["handoff_imported"] >= len(msgs) // 2, dc  # a block file still being written is recomputed
    # promoted by KV_IMPORT jobs, or inside the prefill jobs (workers that announce lane imports)
    imports = counters.get("kv_import_jobs", 0) + counters.get("lane_import_jobs", 0)
    assert counters["tier_hit_tokens"] > 0 and imports > 0, counters
    # the prefill board held each prompt's blocks for the decode board, and let go at the deadline
    assert daemon_counters(p)["handoff_held"] == len(msgs)
    wait_until(lambda: daemon_counters(p)["handoff_expired"] == len(msgs), what="holds expired")
    wait_until(lambda: kv_used_blocks(p) == 0 and kv_used_blocks(d) == 0, what="pools at baseline")


def test_a_transfer_cut_half_way_is_recomputed_not_wrong(daemon, short_dir):
    """The prefill board's block files of a prompt truncated or deleted after its prefill leg (a transfer
    cut half-way, a torn or evicted file): the decode leg imports what checks out, recomputes the rest,
    and its tokens are still the co-located run's."""
    pk, dk = os.path.join(short_dir, "pk"), os.path.join(short_dir, "dk")
    p = daemon(backend="ref", settings={"board.role": "prefill", "kv.disk_dir": pk})
    d = daemon(backend="ref", settings={"board.role": "decode", "kv.disk_dir": dk, "kv.promote": "always",
                                        "board.handoff_peer_dirs": [pk]})
    rng = random.Random(9)
    prompt = [rng.randrange(1, 250) for _ in range(100)]  # 6 full blocks before the last token
    first = run_streams(p.endpoint, [gen_msg("p", prompt, max_tokens=1, handoff={"export": True})])
    (tok,) = streamed_tokens(first["p"])

    def files() -> list[str]:
        out = []
        for root, _, names in os.walk(pk):
            out += [os.path.join(root, n) for n in names if n.endswith(".kv")]
        return out

    wait_until(lambda: len(files()) >= 6, what="the prefill board's block files")
    hit = sorted(files())
    with open(hit[0], "r+b") as f:  # one torn record, one gone
        f.truncate(8)
    os.unlink(hit[1])
    desc = {"board": "p", "request": "p", "prompt_len": len(prompt)}
    got = run_streams(d.endpoint, [gen_msg("d", prompt, max_tokens=12, continuation=[tok], handoff=desc)])
    oracle = run_streams(p.endpoint, [gen_msg("o", prompt, max_tokens=12)])
    assert [tok] + streamed_tokens(got["d"]) == streamed_tokens(oracle["o"])
    (term,) = terminal_events(got["d"])
    assert term["ev"] == "done" and term["usage"]["completion_tokens"] == 11
    with d.client() as c:
        st = c.stats()
    assert st["daemon"]["handoff_imported"] == 1
    # the worker checked every record before writing one: the import was refused whole, the prompt recomputed
    assert st["scheduler"]["counters"].get("tier_refused_imports", 0) == 1
    wait_until(lambda: kv_used_blocks(d) == 0, what="the decode pool at baseline")
