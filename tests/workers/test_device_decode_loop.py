"""The device-side multi-step decode (simpler_model_decode_steps_paged) against the host loop on the reference
chip library: the same tokens and logprobs for greedy and sampled lanes, inactive lanes left alone, the KV it
writes good for the next step; the worker takes it only for the jobs it can run alone; a library without the
symbol still multi-steps through the host loop, and one with the symbol but no device KV is refused."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ipc.records import JobKind, JobStatus, Lane, build_job
from workers.backends.ctypes_backend import CtypesBackend, NativeLibraryError, build_reference_library
from workers.execute_job import device_loop_job, execute_job

BS = 16
TABLE_WIDTH = 6
BATCH = 8
LANES = (0, 1, 3, 4, 5)  # the active lanes of the decode jobs; 2, 6 and 7 are inactive
PROMPTS = ([256, 5, 9, 200, 17, 33, 41], [3] * 30, [256, 99, 3, 7, 7, 120, 64, 1, 2, 250, 11], [77, 78, 79],
           [40 + i for i in range(20)])
TABLES = ([3, 17, 8], [21, 4, 30], [9, 10, 11], [12, 13, 14], [0, 1, 2])
# (temperature, top_p, top_k, seed, want_logprobs) per active lane: greedy, temperature alone,
# top-k + top-p, top-p, top-k
SAMPLING = ((0.0, 1.0, 0, 1, True), (0.9, 1.0, 0, 2, True), (1.3, 0.8, 12, 3, False), (0.7, 0.9, 0, 4, True),
            (2.0, 1.0, 5, 5, True))


@pytest.fixture(scope="module")
def libdir(tmp_path_factory):
    return tmp_path_factory.mktemp("loop")


@pytest.fixture(scope="module")
def library(libdir):
    return str(build_reference_library(libdir))


def _chip(library: str, chip_id: int, **kw) -> CtypesBackend:
    b = CtypesBackend(library=library, chip_id=chip_id, block_size=BS, num_blocks=40, **kw)
    b.load(None)
    return b


def _prefilled(chip) -> list[int]:
    """Prefill every prompt (lane by lane); the first sampled token of each."""
    first = []
    for i, (p, t) in enumerate(zip(PROMPTS, TABLES)):
        temp, top_p, top_k, seed, want = SAMPLING[i]
        out = execute_job(chip, build_job(JobKind.PREFILL, [Lane(p, 0, t, temperature=temp, top_p=top_p,
                                                                 top_k=top_k, seed=seed, want_logprobs=want)]))
        assert out.status == JobStatus.OK, out.error
        first.append(int(out.tokens[0]))
    return first


def _decode_job(first: list[int], n: int, at: int = 0):
    """One decode job of BATCH lanes: prompt i (after `at` decoded tokens) on lane LANES[i], fed first[i]."""
    lanes: list = [None] * BATCH
    for i, lane in enumerate(LANES):
        temp, top_p, top_k, seed, want = SAMPLING[i]
        lanes[lane] = Lane([first[i]], len(PROMPTS[i]) + at, TABLES[i], temperature=temp, top_p=top_p,
                           top_k=top_k, seed=seed, want_logprobs=want)
    return build_job(JobKind.DECODE, lanes, batch=BATCH, table_width=TABLE_WIDTH, decode_steps=n)


@pytest.mark.parametrize("n", [1, 4, 8])
def test_the_device_loop_equals_the_host_loop(library, n):
    device, host = _chip(library, 1), _chip(library, 2, device_loop=False)
    assert device.device_loop and not host.device_loop
    assert device.describe().extra["device_decode_loop"] and not host.describe().extra["device_decode_loop"]
    first = _prefilled(device)
    assert _prefilled(host) == first
    job = _decode_job(first, n)
    blocks = np.arange(40)
    before = device.swap_out(blocks)
    tokens, logprobs = device.decode_steps(job)
    ref = execute_job(host, job)
    assert ref.status == JobStatus.OK, ref.error
    assert tokens.shape == logprobs.shape == (BATCH, n) and tokens.dtype == np.int32
    assert logprobs.dtype == np.float32
    assert np.array_equal(tokens, ref.tokens.reshape(BATCH, -1))
    np.testing.assert_allclose(logprobs, ref.logprobs.reshape(BATCH, -1), rtol=1e-6, atol=1e-6)
    inactive = [lane for lane in range(BATCH) if lane not in LANES]
    assert (tokens[inactive] == -1).all() and not logprobs[inactive].any()
    wants = np.array([s[4] for s in SAMPLING])
    assert (logprobs[np.array(LANES)[wants]] < 0).all() and not logprobs[np.array(LANES)[~wants]].any()
    if n > 1:
        assert len(set(tokens[LANES[1]].tolist())) > 1  # a sampled lane really moved
    # only the new positions of the active lanes changed: no other block
    after = device.swap_out(blocks)
    touched = {TABLES[i][p // BS] for i in range(len(LANES)) for p in range(len(PROMPTS[i]), len(PROMPTS[i]) + n)}
    for blk in blocks.tolist():
        if blk not in touched:
            np.testing.assert_array_equal(after[blk], before[blk])
    # the KV the loop wrote is what the next step reads: both chips continue alike
    nxt = _decode_job([int(tokens[lane, -1]) for lane in LANES], 1, at=n)
    nxt_dev, nxt_host = device.decode(nxt), host.decode(nxt)
    np.testing.assert_array_equal(nxt_dev.logits, nxt_host.logits)


def test_the_worker_runs_a_multi_step_job_on_the_device(library):
    chip = _chip(library, 3)
    first = _prefilled(chip)
    calls = []
    one_step = chip.decode
    chip.decode = lambda job: calls.append(job) or one_step(job)
    out = execute_job(chip, _decode_job(first, 4))
    assert out.status == JobStatus.OK and out.tokens.shape == (BATCH, 4)
    assert calls == []  # no host step at all
    host = _chip(library, 4, device_loop=False)
    assert _prefilled(host) == first
    assert np.array_equal(execute_job(host, _decode_job(first, 4)).tokens, out.tokens)


def test_jobs_the_host_must_see_between_steps_keep_the_host_loop():
    job = _decode_job([5, 6, 7, 8, 9], 4)
    assert device_loop_job(job)
    assert not device_loop_job(_decode_job([5, 6, 7, 8, 9], 1))  # one step: the plain decode
    logits = build_job(JobKind.DECODE, [Lane([5], 7, [3])], decode_steps=4, return_logits=True)
    assert not device_loop_job(logits)
    constrained = build_job(JobKind.DECODE, [Lane([5], 7, [3], constraint=9, constraint_key=1, constraint_done=1)],
                            decode_steps=4)
    assert not device_loop_job(constrained)
    job.sample = job.sample.copy()
    job.sample[LANES[2]] = 0  # a valid lane that does not sample
    assert not device_loop_job(job)


def test_a_library_without_the_symbol_multi_steps_through_the_host_loop(library, libdir):
    for name, defines in (("libnoloop.so", {"REF_DEVICE_LOOP": 0}), ("libhostkv.so", {"REF_DEVICE_KV": 0})):
        lib = str(build_reference_library(libdir, name=name, defines=defines))
        plain = _chip(lib, 5)
        assert not plain.device_loop and not plain.describe().extra["device_decode_loop"]
        assert plain.decode_steps(_decode_job([5, 6, 7, 8, 9], 4)) is None
        first = _prefilled(plain)
        out = execute_job(plain, _decode_job(first, 8))
        assert out.status == JobStatus.OK and out.tokens.shape == (BATCH, 8)
        device = _chip(library, 6)
        assert _prefilled(device) == first
        assert np.array_equal(execute_job(device, _decode_job(first, 8)).tokens, out.tokens)


def test_a_rejected_job_writes_nothing_and_fails_cleanly(library):
    chip = _chip(library, 7)
    first = _prefilled(chip)
    before = chip.swap_out(np.arange(40))
    short = _decode_job(first, 4)
    short.block_tables = short.block_tables.copy()
    short.block_tables[LANES[1], 2] = -1  # the lane of 30 prompt tokens needs its third block from position 32
    with pytest.raises(ValueError, match="block table"):
        chip.decode_steps(short)
    out = execute_job(chip, short)
    assert out.status == JobStatus.FAILED and "block table" in out.error
    np.testing.assert_array_equal(chip.swap_out(np.arange(40)), before)


def test_the_library_leaves_inactive_rows_and_checks_tables_itself(library):
    chip = _chip(library, 8)
    first = _prefilled(chip)
    lib = ctypes.CDLL(library)  # the same loaded library: chip 8's pool
    fn = lib.simpler_model_decode_steps_paged
    fn.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 6
    n = 3
    job = _decode_job(first, n)
    tokens = np.full(BATCH, -5, np.int32)  # an inactive lane's token is never read (nor checked)
    starts = np.zeros(BATCH, np.int32)
    for i, lane in enumerate(LANES):
        tokens[lane], starts[lane] = first[i], len(PROMPTS[i])
    tables = np.ascontiguousarray(job.block_tables, np.int32)
    params = [np.ascontiguousarray(a) for a in (job.temperature, job.top_p, job.top_k, job.seed)]
    out_t, out_l = np.full((BATCH, n), 12345, np.int32), np.full((BATCH, n), 9.5, np.float32)
    ptr = [a.ctypes.data for a in (tokens, job.lane_valid, starts, tables)]
    rc = fn(8, BATCH, n, *ptr, TABLE_WIDTH, *(a.ctypes.data for a in params), out_t.ctypes.data, out_l.ctypes.data)
    assert rc == 0
    inactive = [lane for lane in range(BATCH) if lane not in LANES]
    assert (out_t[inactive] == 12345).all() and (out_l[inactive] == 9.5).all()
    assert (out_t[list(LANES)] != 12345).all()
    before = chip.swap_out(np.arange(40))
    too_far = fn(8, BATCH, 60, *ptr, TABLE_WIDTH, *(a.ctypes.data for a in params), out_t.ctypes.data, None)
    bad_temp = params[0].copy()
    bad_temp[LANES[-1]] = np.nan
    nan_temp = fn(8, BATCH, n, *ptr, TABLE_WIDTH, bad_temp.ctypes.data, *(a.ctypes.data for a in params[1:]),
                  out_t.ctypes.data, None)
    assert too_far == nan_temp == -1  # SIMPLER_E_INVALID, before anything is written
    np.testing.assert_array_equal(chip.swap_out(np.arange(40)), before)


def test_the_symbol_without_device_kv_is_refused(tmp_path):
    lib = build_reference_library(tmp_path, name="libloop_hostkv.so", defines={"REF_DEVICE_KV": 0}, extra_source=(
        "int simpler_model_decode_steps_paged(int c, int b, int n, const int32_t* t, "
        "const uint8_t* v, const int32_t* s, const int32_t* bt, int ts, const float* te, "
        "const float* tp, const int32_t* tk, const uint64_t* se, int32_t* ot, float* ol) { return 0; }\n"))
    with pytest.raises(NativeLibraryError, match="libloop_hostkv.so.*simpler_model_decode_steps_paged without the "
                                                 "device-resident KV group"):
        CtypesBackend(library=str(lib))


def tp_scenario(info):
    """Two prompts, then two 4-step decode jobs (a greedy lane, an inactive one, a sampled one)."""
    rng = np.random.default_rng(8)
    a, b = rng.integers(2, 300, 30).tolist(), rng.integers(2, 300, 20).tolist()
    yield build_job(JobKind.PREFILL, [Lane(a, 0, [0, 1, 2])])
    yield build_job(JobKind.PREFILL, [Lane(b, 0, [5, 6])])
    for s in range(2):
        yield build_job(JobKind.DECODE, [Lane([a[s]], 30 + 4 * s, [0, 1, 2], want_logprobs=True), None,
                                         Lane([b[s]], 20 + 4 * s, [5, 6], temperature=0.9, top_k=20, seed=4,
                                              want_logprobs=True)], batch=4, decode_steps=4)


@pytest.mark.integration
def test_two_tensor_parallel_ranks_loop_on_the_device_as_one_chip_on_the_host(library, tmp_path, monkeypatch):
    from tools.tp_ranks import run_group

    trace = tmp_path / "loop.trace"
    monkeypatch.setenv("REF_LOOP_TRACE", str(trace))  # the rank processes inherit it
    script = "tests.workers.test_device_decode_loop:tp_scenario"
    one = run_group(1, None, script, backend="ctypes", options={"library": library, "device_loop": False})
    assert not trace.exists()
    two = run_group(2, None, script, backend="ctypes", options={"library": library})
    assert trace.read_text().splitlines() == ["0 4 4"] * 4  # each rank looped both jobs on its chip
    assert one.statuses == two.statuses == [int(JobStatus.OK)] * 4
    assert two.allreduce_calls >= 2 + 2 * 4 * 2  # every step of every valid lane reduced its logits in the loop
    for t1, t2, p1, p2 in zip(one.tokens, two.tokens, one.logprobs, two.logprobs):
        assert np.array_equal(t1, t2)
        np.testing.assert_allclose(p1, p2, rtol=1e-6, atol=1e-6)
