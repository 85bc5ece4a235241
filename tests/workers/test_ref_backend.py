"""The ref backend against its cache-free oracle: paged, batched, chunked, shared, swapped."""

from __future__ import annotations

import numpy as np
import pytest

from ipc.records import JobKind
from workers import transformer
from workers.backends.base import BackendError
from workers.backends.ref import RefBackend, full_recompute_logits
from ipc.records import Lane, build_job
from workers.model_maker import make_model
from workers.package_loader import load_package

TOL = 1e-4
BS = 16


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("pkg") / "m"), max_seq=256, kv_num_blocks=128, seed=11)
    return load_package(path)


def _seq(seed: int, n: int) -> list[int]:
    return [256] + np.random.default_rng(seed).integers(0, 256, n - 1).tolist()


def _prefill(b: RefBackend, tokens, table, start: int = 0) -> np.ndarray:
    return b.prefill(build_job(JobKind.PREFILL, [Lane(tokens, start, table)])).logits[0]


def _decode(b: RefBackend, token: int, pos: int, table) -> np.ndarray:
    return b.decode(build_job(JobKind.DECODE, [Lane([token], pos, table)])).logits[0]


def _diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def test_prefill_then_decode_equals_full_recompute(backend, package):
    seq = _seq(1, 60)
    oracle = full_recompute_logits(package, seq)
    table = [17, 3, 90, 41]  # scattered physical blocks
    assert _diff(_prefill(backend, seq[:37], table), oracle[36]) <= TOL
    for pos in range(37, 60):
        assert _diff(_decode(backend, seq[pos], pos, table), oracle[pos]) <= TOL
    # The oracle is not trivially satisfied: a different context gives different logits.
    assert _diff(oracle[59], full_recompute_logits(package, _seq(2, 60))[59]) > 0.1


def test_tied_lm_head_model_matches_its_oracle(tmp_path):
    pkg = load_package(make_model(str(tmp_path / "tied"), tie_embeddings=True, max_seq=128, kv_num_blocks=16,
                                  golden_cases=1))
    assert "lm_head" not in pkg.weights()
    b = RefBackend()
    b.load(pkg)
    seq = _seq(3, 40)
    oracle = full_recompute_logits(pkg, seq)
    assert _diff(_prefill(b, seq[:20], [2, 0]), oracle[19]) <= TOL
    for pos in range(20, 40):
        assert _diff(_decode(b, seq[pos], pos, [2, 0, 5]), oracle[pos]) <= TOL
    assert float(oracle.std()) > 0.5  # logits have spread, not a constant row


def test_batch_of_16_mixed_lanes_equals_each_lane_alone(package):
    lengths = [1, 2, 5, 15, 16, 17, 31, 32, 33, 7, 48, 3, 64, 20, 9, 40]
    seqs = [_seq(100 + i, n + 6) for i, n in enumerate(lengths)]
    tables = [[i * 5 + j for j in range(5)] for i in range(16)]  # 5 blocks = 80 tokens per lane
    batched, alone = RefBackend(), RefBackend()
    batched.load(package)
    alone.load(package)

    # One 16-lane prefill job versus 16 single-lane prefills.
    out = batched.prefill(build_job(JobKind.PREFILL, [Lane(s[:n], 0, t) for s, n, t in zip(seqs, lengths, tables)]))
    for i, (s, n, t) in enumerate(zip(seqs, lengths, tables)):
        assert _diff(out.logits[i], _prefill(alone, s[:n], t)) <= TOL
    # Then six 16-lane decode steps versus each lane decoded alone, and both versus the oracle.
    for step in range(6):
        lanes = [Lane([s[n + step]], n + step, t) for s, n, t in zip(seqs, lengths, tables)]
        out = batched.decode(build_job(JobKind.DECODE, lanes))
        for i, lane in enumerate(lanes):
            single = _decode(alone, lane.tokens[0], lane.start, lane.block_table)
            assert _diff(out.logits[i], single) <= TOL
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        assert _diff(out.logits[i], full_recompute_logits(package, s[: n + 6])[-1]) <= TOL


@pytest.mark.parametrize("cuts", [[15], [16], [17], [16, 32], [15, 17, 33], [1, 2, 3], [8, 24, 40]])
def test_chunked_prefill_equals_one_shot(backend, package, cuts):
    seq = _seq(7, 50)
    table = [9, 4, 30, 2]
    one_shot = RefBackend()
    one_shot.load(package)
    oracle = full_recompute_logits(package, seq)
    bounds = [0, *cuts, len(seq)]
    for a, b in zip(bounds, bounds[1:]):
        logits = _prefill(backend, seq[a:b], table, start=a)
        assert _diff(logits, oracle[b - 1]) <= TOL
        # One-shot prefill of the same prefix, in a fresh cache, gives the same logits.
        assert _diff(logits, _prefill(one_shot, seq[:b], [0, 1, 2, 3])) <= TOL


def test_prefix_blocks_shared_by_two_sequences(backend, package):
    prefix = _seq(20, 32)  # exactly two full blocks
    a = prefix + _seq(21, 10)
    b = prefix + _seq(22, 13)
    assert _diff(_prefill(backend, a, [5, 6, 7]), full_recompute_logits(package, a)[-1]) <= TOL
    # b reuses blocks 5 and 6 through its block table and computes only its suffix.
    logits_b = _prefill(backend, b[32:], [5, 6, 8], start=32)
    assert _diff(logits_b, full_recompute_logits(package, b)[-1]) <= TOL
    # a is unaffected by b: decoding a continues to match its oracle.
    a2 = a + [65]
    assert _diff(_decode(backend, 65, len(a), [5, 6, 7]), full_recompute_logits(package, a2)[-1]) <= TOL


def test_copy_blocks_copy_on_write_of_a_partial_block(backend, package):
    a = _seq(30, 40)  # block 2 of a is partial (8 of 16 slots)
    _prefill(backend, a, [10, 11, 12])
    backend.copy_blocks(np.array([12], np.int32), np.array([13], np.int32))
    # b shares a's full blocks, owns a copy of the partial one, and diverges inside it.
    b = a[:36] + [1, 2, 3]
    logits_b = _prefill(backend, b[36:], [10, 11, 13], start=36)
    assert _diff(logits_b, full_recompute_logits(package, b)[-1]) <= TOL
    assert _diff(_decode(backend, 99, 40, [10, 11, 12]), full_recompute_logits(package, a + [99])[-1]) <= TOL


def test_inactive_lanes_write_no_kv_and_return_zero_logits(backend, package):
    seq = _seq(40, 20)
    _prefill(backend, seq[:19], [1, 2])
    sentinel = np.full((3,) + backend.cache.block_shape(), 7.0, np.float32)
    backend.swap_in(np.array([50, 51, 52]), sentinel)
    job = build_job(JobKind.DECODE, [None, Lane([seq[19]], 19, [1, 2]), None, None])
    job.block_tables[[0, 2, 3], 0] = [50, 51, 52]  # an inactive lane's stale table must still not be written
    out = backend.decode(job)
    assert np.array_equal(backend.swap_out(np.array([50, 51, 52])), sentinel)
    assert np.all(out.logits[[0, 2, 3]] == 0.0)
    assert _diff(out.logits[1], full_recompute_logits(package, seq)[-1]) <= TOL


def test_swap_out_swap_in_round_trip(backend, package):
    seq = _seq(50, 45)
    _prefill(backend, seq[:40], [20, 21, 22])
    host = backend.swap_out(np.array([20, 21, 22]))
    assert host.shape == (3, 2, package.layers, BS, package.kv_heads, package.head_dim)
    backend.swap_in(np.array([20, 21, 22]), np.zeros_like(host))  # the device copy is gone
    assert np.all(backend.swap_out(np.array([20, 21, 22])) == 0)
    backend.swap_in(np.array([60, 61, 62]), host)  # promoted back into different blocks
    oracle = full_recompute_logits(package, seq)
    for pos in range(40, 45):
        assert _diff(_decode(backend, seq[pos], pos, [60, 61, 62]), oracle[pos]) <= TOL


@pytest.mark.parametrize("breakage", ["short_table", "block_out_of_range", "token_out_of_vocab", "gap_in_positions",
                                      "same_slot_twice", "beyond_max_seq"])
def test_invalid_jobs_are_rejected_before_any_kv_write(backend, package, breakage):
    before = backend.swap_out(np.arange(backend.cache.num_blocks)).copy()
    lanes = [Lane(_seq(60, 20), 0, [3, 4])]
    if breakage == "same_slot_twice":
        lanes.append(Lane(_seq(61, 5), 0, [3]))
    job = build_job(JobKind.PREFILL, lanes)
    if breakage == "short_table":
        job.block_tables[0, 1] = -1
    elif breakage == "block_out_of_range":
        job.block_tables[0, 1] = backend.cache.num_blocks
    elif breakage == "token_out_of_vocab":
        job.tokens[3] = package.vocab_size
    elif breakage == "gap_in_positions":
        job.positions[:10] -= 1
    elif breakage == "beyond_max_seq":
        job = build_job(JobKind.PREFILL, [Lane([1, 2], package.max_seq - 1, list(range(package.max_seq // BS + 1)))])
    with pytest.raises(ValueError):
        backend.prefill(job)
    assert np.array_equal(backend.swap_out(np.arange(backend.cache.num_blocks)), before)


def test_describe_comes_from_the_manifest_and_unload_frees(package):
    b = RefBackend(num_blocks=40, chip_id=3)
    with pytest.raises(BackendError):
        b.describe()
    b.load(package)
    info = b.describe()
    assert info.name == "ref" and info.chunked_prefill
    assert info.vocab_size == package.manifest["vocab_size"]
    assert list(info.eos_ids) == package.manifest["eos_ids"]
    assert [p.batch for p in info.profiles] == [1, 4, 8, 16]
    assert all(p.inactive_lane_policy.value == "mask" for p in info.profiles)
    assert (info.kv.block_size, info.kv.num_blocks, info.kv.num_layers) == (BS, 40, package.layers)
    assert info.model_sha256 == package.sha256
    assert b.health()["ok"]
    b.unload()
    assert b.cache is None and not b.health()["ok"]
    with pytest.raises(BackendError):
        b.prefill(build_job(JobKind.PREFILL, [Lane([1], 0, [0])]))


def test_oracle_is_causal(package):
    seq = _seq(70, 30)
    other = seq[:20] + _seq(71, 10)
    a, b = full_recompute_logits(package, seq), full_recompute_logits(package, other)
    assert _diff(a[:20], b[:20]) == 0.0
    assert _diff(a[25], b[25]) > 0.1


def test_prefill_longer_than_one_attention_slice(package, monkeypatch):
    monkeypatch.setattr(transformer, "_QUERY_SLICE", 48)
    b = RefBackend()
    b.load(package)
    seq = _seq(80, 200)  # several query slices, the last one partial
    assert _diff(_prefill(b, seq, list(range(16))), full_recompute_logits(package, seq)[-1]) <= TOL
