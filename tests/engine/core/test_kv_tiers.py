"""KV tiers against the oracle: host and disk hits give the tokens a recomputation gives.

The device pool is 8 blocks of 16 tokens, so a few conversations evict each
other's prefixes; with tiers on, the evicted (written-through) blocks come
back by KV_IMPORT instead of being recomputed. The reference run has no
tiers. Real `ref` backends, a real shared-memory slot pool, real files.
"""

from __future__ import annotations

import os

import pytest

from engine.core.actions import FinishRequest
from engine.core.kv.tier_policy import PromoteMode
from ipc.records import JobResult
from tests.engine.core.tier_harness import Board, boards  # noqa: F401 - a fixture
from workers.execute_job import execute_job

SHARED = [(7 * i + 3) % 300 + 1 for i in range(48)]  # 3 full blocks


def prompt(k: int, extra: int = 9) -> list[int]:
    return SHARED + [(k * 13 + j * 5) % 300 + 1 for j in range(extra)]


def other(k: int) -> list[int]:
    return [(k * 101 + j * 17) % 300 + 1 for j in range(60)]


def run_workload(board: Board, sampled: bool, batched: bool) -> dict[int, list[int]]:
    """Conversations on the shared prefix, with unrelated prompts between them that evict it."""
    kw = dict(temperature=0.8, top_p=0.9, seed=11) if sampled else {}
    rid = 0
    for rnd in range(3):
        group = [prompt(rnd * 2), prompt(rnd * 2 + 1)] if batched else [prompt(rnd)]
        for p in group:
            rid += 1
            board.submit(rid, p, 6, **kw)
        if not batched:
            board.run()
        board.run()
        for j in range(2):  # evict the device copy of SHARED
            rid += 1
            board.submit(rid, other(rnd * 2 + j), 4, **kw)
            board.run()
    return {r: board.tokens.get(r, []) for r in board.terminal}



@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_host_hits_equal_recomputation(boards, sampled, batched):
    ref = run_workload(boards(tiers_on=False), sampled, batched)
    board = boards()
    got = run_workload(board, sampled, batched)
    assert got == ref
    c = board.tiers.counters
    assert c["hit_host_blocks"] > 0 and c["promoted_blocks"] == c["hit_host_blocks"]
    # one terminal each, every one a finish at max_tokens (these prompts reach max_tokens before any EOS)
    assert set(board.terminal) == set(board.submitted) and len(board.submitted) == (12 if batched else 9)
    for rid, t in board.terminal.items():
        n_prompt, max_tokens = board.submitted[rid]
        assert isinstance(t, FinishRequest) and t.request_id == rid, t
        assert t.finish_reason == "length" and len(got[rid]) == max_tokens, t
        assert (t.usage["prompt_tokens"], t.usage["completion_tokens"]) == (n_prompt, max_tokens), t
    board.check_idle()


def test_disk_hits_equal_recomputation(boards, tmp_path):
    ref = run_workload(boards(tiers_on=False), False, False)
    board = boards(host_slots=0, disk_dir=str(tmp_path), disk_blocks=64)
    got = run_workload(board, False, False)
    assert got == ref
    assert board.tiers.counters["hit_disk_blocks"] > 0
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".kv")]) == len(board.tiers.disk)
    board.check_idle()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_bad_disk_block_is_a_miss_and_recomputed(boards, tmp_path, damage):
    ref = Board(tiers_on=False)
    try:
        ref.submit(1, prompt(0), 6)
        ref.run()
        ref.submit(2, prompt(1), 6)
        ref.run()
        want = ref.tokens[2]
    finally:
        ref.close()
    board = boards(host_slots=0, disk_dir=str(tmp_path), disk_blocks=64)
    board.submit(1, prompt(0), 6)
    board.run()
    for j in range(2):
        board.submit(10 + j, other(j), 4)
        board.run()
    files = sorted(os.listdir(tmp_path))
    assert files
    for f in files:  # damage every block file
        path = os.path.join(tmp_path, f)
        data = bytearray(open(path, "rb").read())
        if damage == "flip":
            data[-5] ^= 0xFF
            open(path, "wb").write(data)
        elif damage == "truncate":
            open(path, "wb").write(data[: len(data) // 2])
        else:
            os.unlink(path)
    board.submit(2, prompt(1), 6)
    board.run()
    assert board.tokens[2] == want
    assert board.tiers.counters["miss_refused"] >= 1
    assert board.sched.counters["tier_refused_imports"] >= 1
    board.check_idle()


def test_cross_chip_host_hit(boards):
    board = boards(chips=2, num_blocks=16)
    board.submit(1, prompt(0), 4)
    board.run()
    first_chip = next(c for c, k in board.kinds if k == "PREFILL")
    other_chip = 1 - first_chip
    board.sched.chips[first_chip].in_service = False  # the chip that computed it is unavailable
    board.submit(2, prompt(1), 4)
    board.run()
    assert (other_chip, "KV_IMPORT") in board.kinds
    assert board.tiers.counters["hit_host_blocks"] == 3
    board.sched.chips[first_chip].in_service = True
    board.check_idle()


def _evicting_history(board: Board) -> None:
    board.submit(1, prompt(0), 4)
    board.run()
    for j in range(2):
        board.submit(10 + j, other(j), 4)
        board.run()


def _tick(board: Board) -> None:
    board.now += 0.001
    board.handle(board.sched.tick(board.now))


def _run_until_export(board: Board) -> int:
    """Run jobs until some chip has a KV_EXPORT queued (not run); returns that chip."""
    for _ in range(200):
        _tick(board)
        exports = [c for c, q in enumerate(board.queues) if any(j.kind.name == "KV_EXPORT" for j in q)]
        if exports:
            return exports[0]
        for c, q in enumerate(board.queues):
            if q:
                job = q.popleft()
                out = execute_job(board.backends[c], job, 0.0, board.host_kv[c])
                board.handle(board.sched.on_result(c, JobResult(job.job_id, job.generation, job.kind, out.status,
                                                                out.tokens, out.logprobs), board.now))
    raise AssertionError("no export queued")


def test_cancel_while_the_import_is_in_flight_leaks_nothing(boards):
    board = boards()
    _evicting_history(board)
    board.submit(2, prompt(1), 4)
    _tick(board)
    assert [j.kind.name for j in board.queues[0]] == ["KV_IMPORT"]
    board.handle(board.sched.cancel(2, board.now))
    assert board.terminal[2].finish_reason == "cancelled"
    board.run()  # the import completes after the cancel: its blocks go to the prefix cache, nothing leaks
    board.check_idle()
    kv = board.sched.chips[0].kv
    assert kv.pool.num_free() + kv.cache.evictable() == kv.num_blocks


def test_worker_killed_mid_import_requeues_and_recovers(boards):
    board = boards()
    _evicting_history(board)
    board.submit(2, prompt(1), 4)
    _tick(board)
    assert [j.kind.name for j in board.queues[0]] == ["KV_IMPORT"]
    board.queues[0].clear()  # the worker died with it
    board.handle(board.sched.on_chip_down(0, board.now))
    board.handle(board.sched.on_chip_up(0, board.now))
    board.run()
    ref = Board(tiers_on=False)
    try:
        ref.submit(2, prompt(1), 4)
        ref.run()
        assert board.tokens[2] == ref.tokens[2]
    finally:
        ref.close()
    board.check_idle()
    assert board.tiers.counters["import_failed"] == 1  # counted; its slots were unpinned (check_idle)


def test_worker_killed_mid_export_drops_the_pending_entries(boards):
    board = boards()
    board.submit(1, prompt(0), 4)
    assert _run_until_export(board) == 0
    assert board.tiers.host.pending_count() > 0
    board.queues[0].clear()
    board.handle(board.sched.on_chip_down(0, board.now))
    assert board.tiers.host.pending_count() == 0 and len(board.tiers.host) == 0
    board.handle(board.sched.on_chip_up(0, board.now))
    board.run()
    board.check_idle()


def test_host_pool_full_keeps_outputs_right(boards):
    ref = run_workload(boards(tiers_on=False), False, True)
    board = boards(host_slots=2)
    assert run_workload(board, False, True) == ref
    c = board.tiers.host.counters
    assert c["full"] + c["evicted"] > 0
    board.check_idle()


def test_disk_cap_evicts_least_recent_files(boards, tmp_path):
    board = boards(host_slots=0, disk_dir=str(tmp_path), disk_blocks=4)
    run_workload(board, False, False)
    for chain in board.tiers.take_disk_deletes():  # what the shell does with them
        path = os.path.join(tmp_path, chain.hex() + ".kv")
        if chain not in board.tiers.disk and os.path.exists(path):  # a chain may be let go twice
            os.unlink(path)
    files = [f for f in os.listdir(tmp_path) if f.endswith(".kv")]
    assert len(files) == len(board.tiers.disk) <= 4
    assert board.tiers.disk.counters["evicted"] > 0
    board.check_idle()


def test_block_mid_demotion_is_a_miss_not_a_hit(boards):
    board = boards(chips=2, num_blocks=16)
    board.submit(1, prompt(0), 1)
    chip = _run_until_export(board)  # its export of the prompt is queued, not run
    board.sched.chips[chip].in_service = False
    board.submit(2, prompt(1), 4)
    _tick(board)
    assert board.tiers.counters["miss_pending"] >= 1
    assert not any(j.kind.name == "KV_IMPORT" for q in board.queues for j in q)
    board.sched.chips[chip].in_service = True
    board.run()
    board.check_idle()


def test_cost_policy_promotes_on_ref_where_recompute_costs_more(boards):
    ref = run_workload(boards(tiers_on=False), False, False)
    board = boards(mode=PromoteMode.COST)
    assert run_workload(board, False, False) == ref
    assert board.tiers.counters["hit_host_blocks"] > 0


def test_nothing_is_exported_when_no_hit_could_pay(boards):
    board = boards(mode=PromoteMode.NEVER)
    _evicting_history(board)
    board.submit(2, prompt(1), 4)
    board.run()
    assert not any(k in ("KV_EXPORT", "KV_IMPORT") for _, k in board.kinds)
    assert len(board.tiers.host) == 0 and board.tiers.counters["hit_host_blocks"] == 0
