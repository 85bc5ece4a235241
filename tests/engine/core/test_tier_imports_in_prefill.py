"""Host-tier promotion inside the prefill job that needs it (ipc.lane_imports), against recomputation.

The in-process board of `tier_harness` (real `ref` backends, the worker's own
job code, a real shared-memory slot pool) on the scheduler's fake clock. A
prompt whose prefix blocks were evicted from the chip but sit in the host
tier is served by ONE job: the import and the prefill after it.
"""

from __future__ import annotations

import pytest

from engine.core.actions import FinishRequest
from ipc.records import JobKind
from tests.engine.core.tier_harness import Board, boards  # noqa: F401 - a fixture

SHARED = [(7 * i + 3) % 300 + 1 for i in range(48)]  # 3 full blocks of 16
SHARED2 = [(11 * i + 5) % 300 + 1 for i in range(48)]


def prompt(prefix: list[int], k: int, extra: int = 9) -> list[int]:
    return prefix + [(k * 13 + j * 5) % 300 + 1 for j in range(extra)]


def other(k: int) -> list[int]:
    return [(k * 101 + j * 17) % 300 + 1 for j in range(60)]



def _tick(board: Board) -> None:
    board.now += 0.001
    board.handle(board.sched.tick(board.now))


def _history(board: Board, prefixes: list[list[int]]) -> list[set[int]]:
    """Compute each prefix once (written through to the host tier), then evict them all from the chip; returns
    the host slots each prefix's blocks took."""
    slots = []
    for i, pre in enumerate(prefixes):
        before = {board.tiers.host.entry(c).slot for c in board.tiers.host.chains()}
        board.submit(100 + i, prompt(pre, 0), 4)
        board.run()
        slots.append({board.tiers.host.entry(c).slot for c in board.tiers.host.chains()} - before)
    for j in range(3):
        board.submit(200 + j, other(j), 4)
        board.run()
    return slots


def _reference(prompts: dict[int, list[int]]) -> dict[int, list[int]]:
    ref = Board(tiers_on=False)
    try:
        for rid, p in prompts.items():
            ref.submit(rid, p, 6)
            ref.run()
        return {rid: ref.tokens[rid] for rid in prompts}
    finally:
        ref.close()


def test_host_hit_is_promoted_in_the_prefill_job(boards):
    board = boards(lane_imports=True)
    _history(board, [SHARED])
    p = prompt(SHARED, 1)
    board.submit(1, p, 6)
    _tick(board)  # admission and the first jobs, no result yet
    (job,) = board.queues[0]  # one job on the chip, not an import waiting for its result
    assert job.kind is JobKind.PREFILL
    assert job.imports is not None and job.imports.lanes() == [0]
    src, dst, where, _ = job.imports.of_lane(0)
    assert len(dst) == 3 and where == [1, 1, 1]  # the three prefix blocks, from the host tier
    assert int(job.positions[0]) == 48  # the prefill starts after the promoted tokens
    assert list(dst) == list(job.block_tables[0][:3])  # into the blocks the lane reads
    board.run()
    assert not any(k == "KV_IMPORT" for _, k in board.kinds)
    assert board.tokens[1] == _reference({1: p})[1]
    assert board.tiers.counters["promoted_blocks"] == 3
    assert board.sched.counters["lane_import_jobs"] == 1
    board.check_idle()


def test_workers_without_lane_imports_keep_the_import_job(boards):
    board = boards(lane_imports=False)  # a worker that does not announce extra.lane_imports
    _history(board, [SHARED])
    board.submit(1, prompt(SHARED, 1), 6)
    _tick(board)
    assert [j.kind.name for j in board.queues[0]] == ["KV_IMPORT"]
    assert all(j.imports is None for _, j in board.jobs)
    board.run()
    board.check_idle()


def test_refused_import_recomputes_its_lane_only(boards):
    """Two prompts in one mixed job, each depending on its own imported blocks; one prefix is corrupt in the
    host pool. That lane is refused (nothing written, not run) and recomputed; the other lane completes in the
    job; each request ends once, with the tokens recomputation gives."""
    board = boards(lane_imports=True, mixed_batch_tokens=256, num_blocks=12)
    bad_slots, _ = _history(board, [SHARED, SHARED2])
    assert len(bad_slots) == 3
    for s in bad_slots:
        board.pool.slot(s)[200] ^= 0xFF  # a flipped byte in each record of SHARED's blocks
    a, b = prompt(SHARED, 1), prompt(SHARED2, 1)
    board.submit(1, a, 6)
    board.submit(2, b, 6)
    _tick(board)
    (job,) = board.queues[0]
    assert job.kind is JobKind.PREFILL and job.imports is not None and job.imports.lanes() == [0, 1]
    first = len(board.jobs)
    board.run()
    want = _reference({1: a, 2: b})
    assert board.tokens[1] == want[1] and board.tokens[2] == want[2]
    assert isinstance(board.terminal[1], FinishRequest) and isinstance(board.terminal[2], FinishRequest)
    assert board.tiers.counters["miss_refused"] == 1  # lane 0's import
    assert board.tiers.counters["promoted_blocks"] == 3  # lane 1's
    assert board.sched.counters["tier_refused_imports"] == 1
    later = [(j, lane) for _, j in board.jobs[first:] if j.kind is JobKind.PREFILL for lane in range(j.batch)
             if j.lane_valid[lane] and len(j.lane_tokens(lane)) > 1]
    redone = [(int(j.lane_positions(lane)[0]), j.lane_tokens(lane).tolist()) for j, lane in later]
    assert (0, a) in redone  # the refused lane's prompt, computed again from its start
    assert not any(toks == b[pos:pos + len(toks)] for pos, toks in redone)  # lane 1's prompt was not redone
    board.check_idle()


def test_worker_killed_with_the_job_in_flight_unpins_and_recovers(boards):
    board = boards(lane_imports=True)
    _history(board, [SHARED])
    p = prompt(SHARED, 1)
    board.submit(1, p, 6)
    _tick(board)
    (job,) = board.queues[0]
    assert job.imports is not None
    board.queues[0].clear()  # the worker died with it
    board.handle(board.sched.on_chip_down(0, board.now))
    board.handle(board.sched.on_chip_up(0, board.now))
    board.run()
    assert board.tokens[1] == _reference({1: p})[1]
    assert board.tiers.counters["import_failed"] == 1
    board.check_idle()  # no host entry is left pinned by the lost job


def test_cancel_before_the_job_goes_unpins_the_plan(boards):
    board = boards(lane_imports=True, num_blocks=16)
    _history(board, [SHARED])
    for j in range(3):  # the chip's job slots fill up: the next prompt waits in the prefill queue
        board.submit(300 + j, other(10 + j)[:20], 4)
    _tick(board)
    board.submit(1, prompt(SHARED, 1), 6)
    _tick(board)
    # admitted, its promotion planned (the host entries pinned), and no job of it sent yet
    assert any(board.tiers.host.entry(c).readers for c in board.tiers.host.chains())
    assert not any(j.imports is not None for _, j in board.jobs)
    board.handle(board.sched.cancel(1, board.now))
    assert board.terminal[1].finish_reason == "cancelled"
    board.run()
    assert not any(j.imports is not None for _, j in board.jobs)
    board.check_idle()  # the plan's entries were unpinned when the request let go of its KV
