"""A hand-off on one host through the prefill board's host KV slot pool (engine/daemon/handoff/shm.py).

Two real `ref` boards with separate disk dirs, no `board.handoff_peer_dirs` and no transfer endpoint: the
decode board can only have the prompt's blocks by copying them out of the prefill board's shared-memory
host pool. Imported, the outputs equal the co-located run; a slot overwritten (or the segment gone)
between the two legs is recomputed with the same tokens; no segment outlives its board.
"""

from __future__ import annotations

import random

import pytest
from balancer_procs import tcp_daemon, tcp_endpoint
from raw_streams import gen_msg, run_streams, streamed_tokens, terminal_events
from test_balancer_disagg import daemon_counters

from daemon_procs import shm_objects_of
from waiting import wait_until

pytestmark = pytest.mark.integration


def _boards(daemon, short_dir, **prefill):
    p, _ = tcp_daemon(daemon, backend="ref", settings={"board.role": "prefill", "kv.host_pool_mb": 8,
                                                        "kv.disk_dir": f"{short_dir}/pk",
                                                        "board.handoff_deadline_s": 60.0, **prefill})
    d, _ = tcp_daemon(daemon, backend="ref", settings={"board.role": "decode", "kv.disk_dir": f"{short_dir}/dk",
                                                        "kv.promote": "always"})
    return p, d


def _exported(p) -> bool:
    with p.client() as c:
        host = c.stats()["scheduler"]["kv_tiers"]["host"]
    return host["pending"] == 0 and host["blocks"] > 0


def _hand_off(p, d, rid, prompt, spoil=None, **kw):
    """The two legs by hand (as the balancer runs them); `spoil(descriptor)` runs between them."""
    first = run_streams(p.endpoint, [gen_msg(rid + "p", prompt, max_tokens=1, handoff={"export": True}, **kw)])
    (done,) = terminal_events(first[rid + "p"])
    desc = done["handoff"]
    assert desc["host_pool"]["name"]
    wait_until(lambda: _exported(p), what="the prompt's blocks in the host pool")
    if spoil is not None:
        spoil(desc)
    tok = streamed_tokens(first[rid + "p"])
    got = run_streams(d.endpoint, [gen_msg(rid, prompt, max_tokens=8, continuation=tok, handoff=desc, **kw)])
    (term,) = terminal_events(got[rid])
    assert term["ev"] == "done" and term["usage"], str(term)
    assert term["usage"]["prompt_tokens"] == len(prompt)
    return tok + streamed_tokens(got[rid])


def test_the_decode_board_copies_the_blocks_from_the_prefill_boards_host_pool(daemon, short_dir):
    p, d = _boards(daemon, short_dir)
    rng = random.Random(28)
    prompts = [[rng.randrange(1, 250) for _ in range(rng.randrange(40, 200))] for _ in range(4)]
    for i, prompt in enumerate(prompts):
        kw = {"temperature": 0.8, "seed": 5 + i} if i % 2 else {}
        got = _hand_off(p, d, f"r{i}", prompt, ignore_eos=True, **kw)
        oracle = run_streams(p.endpoint, [gen_msg("o", prompt, max_tokens=8, ignore_eos=True, **kw)])
        assert got == streamed_tokens(oracle["o"]), i
    with d.client() as c:
        st = c.stats()
    dc, counters = st["daemon"], st["scheduler"]["counters"]
    assert dc["handoff_imported"] == len(prompts) and dc["handoff_recomputed"] == 0, dc
    assert dc["handoff_shm_blocks"] > 0 and counters["tier_hit_tokens"] > 0, (dc, counters)
    pids = (p.pid, d.pid)
    p.stop()
    d.stop()
    assert [shm_objects_of(pid) for pid in pids] == [[], []]


def test_with_a_transfer_endpoint_the_copy_is_still_from_shared_memory_and_releases_the_hold(daemon, short_dir):
    p, d = _boards(daemon, short_dir, **{"board.handoff_endpoint": tcp_endpoint()})
    prompt = [random.Random(30).randrange(1, 250) for _ in range(150)]
    got = _hand_off(p, d, "r", prompt, ignore_eos=True)
    assert got == streamed_tokens(run_streams(p.endpoint, [gen_msg("o", prompt, max_tokens=8, ignore_eos=True)])["o"])
    dc = daemon_counters(d)
    assert dc["handoff_shm_blocks"] > 0 and dc.get("handoff_pulled_blocks", 0) == 0, dc
    wait_until(lambda: daemon_counters(p).get("handoff_released") == 1, what="the hold released")
    assert daemon_counters(p).get("handoff_expired", 0) == 0


def test_an_overwritten_slot_or_a_lost_segment_is_recomputed(daemon, short_dir):
    from ipc.kv_slots import KvSlotPool

    p, d = _boards(daemon, short_dir)
    rng = random.Random(29)

    def overwrite(desc):  # every record of the prefill board's pool fails its checksum now
        hp = desc["host_pool"]
        pool = KvSlotPool.attach(hp["name"], hp["slots"], hp["slot_bytes"])
        for i in range(pool.slots):
            s = pool.slot(i)
            s[100] ^= 0xFF
            del s
        pool.close()

    def hide(desc):  # the segment is not where the descriptor says
        desc["host_pool"] = {**desc["host_pool"], "name": desc["host_pool"]["name"] + "-gone"}

    for i, spoil in enumerate((overwrite, hide)):
        prompt = [rng.randrange(1, 250) for _ in range(120)]
        oracle = run_streams(p.endpoint, [gen_msg("o", prompt, max_tokens=8, ignore_eos=True)])
        assert _hand_off(p, d, f"r{i}", prompt, spoil=spoil, ignore_eos=True) == streamed_tokens(oracle["o"])
    dc = daemon_counters(d)
    assert dc["handoff_shm_refused"] == 2 and dc["handoff_recomputed"] == 2 and dc.get("handoff_imported", 0) == 0
