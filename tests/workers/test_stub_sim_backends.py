"""stub and sim backends, the sim latency model, and the backend registry."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ipc.records import Job, JobKind
from workers.backends import sim as sim_module
from workers.backends.base import BackendError, ChipBackend
from workers.backends.registry import BACKENDS, backend_class, make_backend
from workers.backends.sim import SimBackend
from workers.backends.sim_latency import LatencyModel
from workers.backends.stub import StubBackend


def make_job(kind: JobKind, lanes: list[dict | None], max_blocks: int = 4) -> Job:
    """lanes[i] = None (inactive) or {tokens, start, seed, sample}."""
    b = len(lanes)
    toks, poss, qs = [], [], [0]
    ctx = np.zeros(b, np.int32)
    valid = np.zeros(b, np.uint8)
    sample = np.zeros(b, np.uint8)
    seed = np.zeros(b, np.uint64)
    tables = np.full((b, max_blocks), -1, np.int32)
    for i, lane in enumerate(lanes):
        if lane is not None:
            t = list(lane["tokens"])
            toks += t
            poss += list(range(lane["start"], lane["start"] + len(t)))
            ctx[i] = lane["start"] + len(t)
            valid[i] = 1
            sample[i] = lane.get("sample", 1)
            seed[i] = lane["seed"]
            tables[i, 0] = i
        qs.append(len(toks))
    job = Job(
        job_id=1, generation=0, kind=kind,
        tokens=np.array(toks, np.int32), positions=np.array(poss, np.int32),
        query_start=np.array(qs, np.int32), lane_valid=valid, context_lens=ctx,
        block_tables=tables, sample=sample, temperature=np.ones(b, np.float32),
        top_p=np.ones(b, np.float32), top_k=np.zeros(b, np.int32), seed=seed,
        want_logprobs=np.zeros(b, np.uint8),
    )
    job.validate()
    return job


def decode_lane(seed: int, pos: int) -> dict:
    return {"tokens": [5], "start": pos, "seed": seed}


def loaded(backend: ChipBackend) -> ChipBackend:
    backend.load(None)
    return backend


# -- stub ------------------------------------------------------------------------------------

lane_st = st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2000))


@settings(max_examples=40, deadline=None)
@given(pairs=st.lists(lane_st, min_size=1, max_size=16), shift=st.integers(0, 15))
def test_stub_token_depends_only_on_seed_and_position(pairs, shift):
    stub = loaded(StubBackend())
    batch = stub.decode(make_job(JobKind.DECODE, [decode_lane(s, p) for s, p in pairs])).tokens
    other_chip = loaded(StubBackend(chip_id=5))
    for i, (s, p) in enumerate(pairs):
        alone = stub.decode(make_job(JobKind.DECODE, [decode_lane(s, p)])).tokens
        # the same lane placed at another index of a 16-lane batch, on another chip
        lanes = [None] * 16
        lanes[shift] = decode_lane(s, p)
        moved = other_chip.decode(make_job(JobKind.DECODE, lanes)).tokens
        assert alone[0] == batch[i] == moved[shift]


def test_stub_prefill_and_decode_agree_on_the_token_at_a_position():
    # a retry that re-prefills a sequence must see the token the decode would have produced
    stub = loaded(StubBackend())
    pre = stub.prefill(make_job(JobKind.PREFILL, [{"tokens": [3, 4, 5, 6], "start": 0, "seed": 99}]))
    dec = stub.decode(make_job(JobKind.DECODE, [decode_lane(99, 3)]))
    assert pre.tokens[0] == dec.tokens[0]
    assert pre.logits is None and dec.logits is None


def test_stub_tokens_vary_with_seed_and_position_and_stay_in_vocab():
    stub = loaded(StubBackend(vocab_size=320))
    lanes = [decode_lane(seed, pos) for seed in range(8) for pos in range(0, 100, 10)]
    toks = np.concatenate([stub.decode(make_job(JobKind.DECODE, lanes[i : i + 16])).tokens for i in range(0, 80, 16)])
    assert toks.min() >= 0 and toks.max() < 320
    assert len(set(toks.tolist())) > 40  # a hash, not a constant or a counter mod small


def test_stub_never_emits_eos():
    stub = loaded(StubBackend(vocab_size=5, eos_ids=(0, 2, 4, 99)))
    lanes = [decode_lane(seed, pos) for seed in range(16) for pos in range(16)]
    toks = np.concatenate([stub.decode(make_job(JobKind.DECODE, lanes[i : i + 16])).tokens for i in range(0, 256, 16)])
    assert set(toks.tolist()) == {1, 3}


def test_stub_inactive_and_non_sampled_lanes_get_minus_one():
    stub = loaded(StubBackend())
    job = make_job(JobKind.DECODE, [None, decode_lane(1, 7), None, decode_lane(2, 9)])
    toks = stub.decode(job).tokens
    assert toks[0] == -1 and toks[2] == -1 and toks[1] >= 0 and toks[3] >= 0
    chunk = make_job(JobKind.PREFILL, [{"tokens": [1, 2, 3], "start": 0, "seed": 1, "sample": 0}])
    assert stub.prefill(chunk).tokens.tolist() == [-1]


def test_stub_describe_and_lifecycle():
    stub = StubBackend(vocab_size=100, eos_ids=(7,), max_seq=64, block_size=32, num_blocks=10, profiles=(8, 1))
    info = stub.describe()
    assert info.name == "stub" and info.vocab_size == 100 and info.eos_ids == (7,)
    assert [p.batch for p in info.profiles] == [1, 8]
    assert info.kv.block_size == 32 and info.kv.num_blocks == 10 and info.chunked_prefill
    job = make_job(JobKind.DECODE, [decode_lane(1, 3)])
    with pytest.raises(BackendError, match="no model loaded"):
        stub.decode(job)
    stub.load(None)
    assert stub.decode(job).tokens[0] >= 0
    with pytest.raises(ValueError):
        stub.prefill(job)  # a decode job
    with pytest.raises(ValueError, match="max_seq"):
        stub.decode(make_job(JobKind.DECODE, [decode_lane(1, 64)]))
    stub.unload()
    with pytest.raises(BackendError):
        stub.decode(job)


def test_stub_kv_ops_are_shaped_no_ops():
    stub = loaded(StubBackend(block_size=16, num_blocks=8))
    data = stub.swap_out(np.array([1, 2, 3]))
    assert data.shape[0] == 3 and data.nbytes > 0 and not data.any()
    stub.swap_in(np.array([4, 5, 6]), data)
    stub.copy_blocks(np.array([0, 1]), np.array([2, 3]))
    with pytest.raises(ValueError):
        stub.swap_in(np.array([4, 5]), data)
    with pytest.raises(ValueError):
        stub.copy_blocks(np.array([0]), np.array([8]))
    with pytest.raises(ValueError):
        stub.copy_blocks(np.array([0, 1]), np.array([2]))


# -- sim latency model ---------------------------------------------------------------------------


def test_latency_model_defaults_are_the_documented_ones():
    m = LatencyModel()
    assert m.decode_seconds(0) == pytest.approx(0.018)
    assert m.decode_seconds(16) == pytest.approx(0.018 + 16 * 0.00012)
    # 1000 tokens x 14 GFLOP / 312 TFLOP/s = 44.87 ms
    assert m.prefill_seconds(1000) == pytest.approx(0.0448718, rel=1e-5)
    assert m.prefill_seconds(0) == 0.0


def test_latency_model_custom_constants():
    m = LatencyModel(decode_base_ms=5, decode_per_lane_ms=1, flops_per_token=1e9, throughput_flops=1e12, prefill_base_ms=2)
    assert m.decode_seconds(3) == pytest.approx(0.008)
    assert m.prefill_seconds(10) == pytest.approx(0.002 + 0.01)
    with pytest.raises(ValueError):
        m.decode_seconds(-1)
    with pytest.raises(ValueError):
        LatencyModel(throughput_flops=0)


def _recorded_wait(monkeypatch, sim: SimBackend) -> list[float]:
    """Freeze the sim's clock at 100 s and record how long it would wait."""
    waits: list[float] = []
    monkeypatch.setattr(sim_module.time, "monotonic", lambda: 100.0)
    monkeypatch.setattr(sim, "_wait_until", lambda deadline: waits.append(deadline - 100.0))
    return waits


def test_sim_decode_waits_for_active_lanes_only(monkeypatch):
    sim = loaded(SimBackend(decode_base_ms=10, decode_per_lane_ms=1, time_scale=0.5))
    waits = _recorded_wait(monkeypatch, sim)
    sim.decode(make_job(JobKind.DECODE, [decode_lane(1, 1), None, decode_lane(2, 5), None]))
    assert waits == [pytest.approx(0.5 * 0.012)]
    assert sim.decode_seconds(2) == pytest.approx(0.012)


def test_sim_prefill_waits_for_its_token_count(monkeypatch):
    sim = loaded(SimBackend(flops_per_token=1e9, throughput_flops=1e12, prefill_base_ms=1))
    waits = _recorded_wait(monkeypatch, sim)
    sim.prefill(make_job(JobKind.PREFILL, [{"tokens": list(range(40)), "start": 16, "seed": 3}]))
    assert waits == [pytest.approx(0.001 + 40 * 1e-3)]


def test_sim_device_queues_a_job_behind_the_previous_one(monkeypatch):
    """Two jobs in flight (ping/pong): the second starts when the first ends on
    the modelled device, not when the worker's host code picks it up."""
    sim = loaded(SimBackend(decode_base_ms=10, decode_per_lane_ms=2))
    waits = _recorded_wait(monkeypatch, sim)
    first = make_job(JobKind.DECODE, [decode_lane(1, 1)])
    second = make_job(JobKind.DECODE, [decode_lane(2, 2)])
    first.submitted_ns = second.submitted_ns = 100_000_000_000  # both handed over at t=100 s
    sim.decode(first)
    sim.decode(second)
    assert waits == [pytest.approx(0.012), pytest.approx(0.024)]


def test_sim_idle_device_starts_a_job_at_its_submission(monkeypatch):
    sim = loaded(SimBackend(decode_base_ms=10, decode_per_lane_ms=2))
    waits = _recorded_wait(monkeypatch, sim)
    job = make_job(JobKind.DECODE, [decode_lane(1, 1)])
    job.submitted_ns = 99_995_000_000  # 5 ms before the worker called the backend
    sim.decode(job)
    assert waits == [pytest.approx(0.007)]


def test_sim_job_without_submission_time_starts_when_called(monkeypatch):
    sim = loaded(SimBackend(decode_base_ms=10, decode_per_lane_ms=2))
    waits = _recorded_wait(monkeypatch, sim)
    sim.decode(make_job(JobKind.DECODE, [decode_lane(1, 1)]))
    assert waits == [pytest.approx(0.012)]


@pytest.mark.parametrize("busy_wait", [False, True])
def test_sim_decode_takes_at_least_the_modelled_time(busy_wait):
    sim = loaded(SimBackend(decode_base_ms=100, decode_per_lane_ms=10, time_scale=0.1, busy_wait=busy_wait))
    job = make_job(JobKind.DECODE, [decode_lane(1, 1), decode_lane(2, 2)])
    t0 = time.perf_counter()
    out = sim.decode(job)
    assert time.perf_counter() - t0 >= 0.1 * 0.120
    assert out.tokens.tolist() == loaded(StubBackend()).decode(job).tokens.tolist()


def test_sim_describe_carries_the_latency_model():
    info = SimBackend(decode_base_ms=7).describe()
    assert info.name == "sim" and info.extra["latency"]["decode_base_ms"] == 7


# -- registry --------------------------------------------------------------------------------------


def test_registry_builds_stub_and_sim_with_options():
    stub = make_backend("stub", vocab_size=50, eos_ids=(3,))
    assert isinstance(stub, StubBackend) and stub.describe().vocab_size == 50
    sim = make_backend("sim", time_scale=0.0, vocab_size=60)
    assert isinstance(sim, SimBackend) and sim.describe().vocab_size == 60
    with pytest.raises(TypeError):
        make_backend("stub", no_such_option=1)


def test_backend_signatures_name_the_kv_options():
    # the daemon passes only the constructor parameters it finds by inspect.signature
    import inspect

    for name in ("stub", "sim"):
        params = inspect.signature(backend_class(name).__init__).parameters
        assert {"block_size", "num_blocks", "chip_id"} <= set(params)
    sim = make_backend("sim", block_size=32, num_blocks=7, chip_id=3)
    assert (sim.describe().kv.block_size, sim.describe().kv.num_blocks, sim.chip_id) == (32, 7, 3)


def test_registry_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as exc:
        make_backend("gpu")
    for name in BACKENDS:
        assert name in str(exc.value)
    assert BACKENDS == ("stub", "sim", "ref", "ctypes", "llamacpp")


def test_registry_maps_ref_to_the_ref_module():
    cls = backend_class("ref")
    assert cls.__name__ == "RefBackend" and cls.__module__ == "workers.backends.ref"
    assert issubclass(cls, ChipBackend)


@pytest.mark.parametrize("cls", [StubBackend, SimBackend])
def test_fail_job_raises_once_on_the_chosen_chip_only(cls):
    """The chaos hook: the N-th compute job of chip `fail_chip` raises BackendError, every other job runs."""
    opts = {"time_scale": 0.0} if cls is SimBackend else {}
    victim = loaded(cls(fail_job=3, fail_chip=1, chip_id=1, **opts))
    other = loaded(cls(fail_job=3, fail_chip=1, chip_id=0, **opts))
    job = make_job(JobKind.DECODE, [decode_lane(5, 10)])
    outcomes = []
    for _ in range(6):
        try:
            victim.decode(job)
            outcomes.append("ok")
        except BackendError as e:
            assert "injected failure of job 3" in str(e)
            outcomes.append("raised")
    assert outcomes == ["ok", "ok", "raised", "ok", "ok", "ok"]
    for _ in range(6):
        other.decode(job)
