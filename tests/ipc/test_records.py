"""Job / JobResult records: the packed wire format round-trips exactly, and validate() judges like a lane loop.

The validate() oracle below is the per-lane loop the vectorised check
replaced, kept here verbatim in spirit: an independent statement of what a
coherent job is, so the two must accept and reject the same jobs, naming
the same lane.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc.records import Job, JobKind, JobResult, JobStatus, Lane, build_job, decode_job
from ipc.ring import Ring

FIELDS = ("tokens", "positions", "query_start", "lane_valid", "context_lens", "block_tables", "sample",
          "temperature", "top_p", "top_k", "seed", "want_logprobs", "src_blocks", "dst_blocks")
DTYPES = {"tokens": np.int32, "positions": np.int32, "query_start": np.int32, "lane_valid": np.uint8,
          "context_lens": np.int32, "block_tables": np.int32, "sample": np.uint8, "temperature": np.float32,
          "top_p": np.float32, "top_k": np.int32, "seed": np.uint64, "want_logprobs": np.uint8,
          "src_blocks": np.int32, "dst_blocks": np.int32}


def assert_same_job(a: Job, b: Job) -> None:
    assert (a.job_id, a.generation, a.kind, a.return_logits, a.submitted_ns, a.queue_next_step) == \
        (b.job_id, b.generation, b.kind, b.return_logits, b.submitted_ns, b.queue_next_step)
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def oracle_validate(job: Job) -> None:
    """The lane-by-lane check validate() must agree with."""
    b = job.batch
    if job.kind == JobKind.KV_COPY:
        if job.src_blocks.shape != job.dst_blocks.shape:
            raise ValueError("src_blocks and dst_blocks differ in length")
        return
    if job.query_start.shape != (b + 1,) or job.query_start[0] != 0:
        raise ValueError("query_start must have B+1 entries starting at 0")
    if np.any(np.diff(job.query_start) < 0) or job.query_start[-1] != job.tokens.shape[0]:
        raise ValueError("query_start must be non-decreasing and end at len(tokens)")
    if job.positions.shape != job.tokens.shape:
        raise ValueError("positions and tokens differ in length")
    for name in ("context_lens", "sample", "temperature", "top_p", "top_k", "seed", "want_logprobs"):
        if getattr(job, name).shape != (b,):
            raise ValueError(f"{name} must have one entry per lane")
    if job.block_tables.ndim != 2 or job.block_tables.shape[0] != b:
        raise ValueError("block_tables must be [B, M]")
    for lane in range(b):
        lo, hi = int(job.query_start[lane]), int(job.query_start[lane + 1])
        n = hi - lo
        if not job.lane_valid[lane]:
            if n:
                raise ValueError(f"inactive lane {lane} carries tokens")
            continue
        if job.kind == JobKind.DECODE and n != 1:
            raise ValueError(f"decode lane {lane} must carry exactly one token")
        if n and int(job.positions[hi - 1]) + 1 != int(job.context_lens[lane]):
            raise ValueError(f"lane {lane}: context_lens must be last position + 1")


def verdict(check, job: Job) -> str | None:
    try:
        check(job)
    except ValueError as exc:
        return str(exc)
    return None


# -- strategies -------------------------------------------------------------------

@st.composite
def coherent_jobs(draw) -> Job:
    kind = draw(st.sampled_from([JobKind.PREFILL, JobKind.DECODE]))
    batch = draw(st.sampled_from([1, 4, 8, 16]))
    lanes: list[Lane | None] = []
    for _ in range(batch):
        if draw(st.booleans()) and (lanes or batch > 1):
            lanes.append(None)
            continue
        n = 1 if kind == JobKind.DECODE else draw(st.integers(1, 40))
        lanes.append(Lane(
            tokens=draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n)),
            start=draw(st.integers(0, 3000)),
            block_table=draw(st.lists(st.integers(0, 4095), min_size=0, max_size=6)),
            sample=draw(st.booleans()), temperature=draw(st.sampled_from([0.0, 0.7, 1.3])),
            top_p=draw(st.sampled_from([1.0, 0.9])), top_k=draw(st.sampled_from([0, 5, 50])),
            seed=draw(st.integers(0, 2**64 - 1)), want_logprobs=draw(st.booleans()),
        ))
    if all(ln is None for ln in lanes):
        lanes[0] = Lane([1], 0, [0])
    return build_job(kind, lanes, job_id=draw(st.integers(0, 2**62)), generation=draw(st.integers(0, 2**31)),
                     table_width=draw(st.sampled_from([None, 8])), return_logits=draw(st.booleans()),
                     queue_next_step=draw(st.booleans()))


def lane_by_lane_job(kind: JobKind, lanes: list, batch: int | None, table_width: int | None) -> dict:
    """The packing build_job must produce, written out one lane at a time (the oracle of its columns)."""
    b = len(lanes) if batch is None else batch
    active = [ln for ln in lanes if ln is not None]
    width = max(1, table_width if table_width is not None else max([len(ln.block_table) for ln in active] or [1]))
    out = {"tokens": [], "positions": [], "query_start": [0] * (b + 1), "lane_valid": [0] * b,
           "context_lens": [0] * b, "block_tables": [[-1] * width for _ in range(b)], "sample": [0] * b,
           "temperature": [0.0] * b, "top_p": [1.0] * b, "top_k": [0] * b, "seed": [0] * b,
           "want_logprobs": [0] * b}
    at = 0
    for i in range(b):
        ln = lanes[i] if i < len(lanes) else None
        if ln is not None:
            n = len(ln.tokens)
            out["tokens"] += list(ln.tokens)
            out["positions"] += list(range(ln.start, ln.start + n))
            at += n
            out["lane_valid"][i] = 1
            out["context_lens"][i] = ln.start + n
            out["block_tables"][i][:len(ln.block_table)] = ln.block_table
            for f in ("sample", "temperature", "top_p", "top_k", "want_logprobs"):
                out[f][i] = getattr(ln, f)
            out["seed"][i] = ln.seed & 0xFFFFFFFFFFFFFFFF
        out["query_start"][i + 1] = at
    return out


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_build_job_packs_every_column_as_the_lane_by_lane_oracle(data):
    kind = data.draw(st.sampled_from([JobKind.PREFILL, JobKind.DECODE]))
    n_lanes = data.draw(st.integers(1, 16))
    batch = data.draw(st.sampled_from([None, 16]))
    lanes: list = []
    for _ in range(n_lanes):
        if data.draw(st.integers(0, 3)) == 0:
            lanes.append(None)
            continue
        n = 1 if kind == JobKind.DECODE else data.draw(st.integers(1, 30))
        lanes.append(Lane(tokens=data.draw(st.lists(st.integers(-1, 1000), min_size=n, max_size=n)),
                          start=data.draw(st.integers(0, 3000)),
                          block_table=data.draw(st.lists(st.integers(0, 4095), max_size=7)),
                          sample=data.draw(st.booleans()), temperature=data.draw(st.sampled_from([0.0, 0.7, 1.5])),
                          top_p=data.draw(st.sampled_from([0.1, 0.5, 1.0])), top_k=data.draw(st.integers(0, 100)),
                          seed=data.draw(st.integers(-2**63, 2**64 - 1)), want_logprobs=data.draw(st.booleans())))
    width = data.draw(st.sampled_from([None, 7, 9]))
    job = build_job(kind, lanes, batch=batch, table_width=width)
    want = lane_by_lane_job(kind, lanes, batch, width)
    for name, values in want.items():
        got = getattr(job, name)
        exp = np.array(values, DTYPES[name])
        if name in ("tokens", "positions"):
            exp = exp.reshape(-1)  # an empty list is shape (0,) too
        assert got.dtype == exp.dtype and got.shape == exp.shape, (name, got.shape, exp.shape)
        np.testing.assert_array_equal(got, exp, err_msg=name)


MUTATIONS = ("ctx", "flip_valid", "qs_entry", "position", "drop_token", "as_decode", "lane_shape", "table_rows",
             "qs_start", "none")


@st.composite
def mutated_jobs(draw) -> Job:
    """Coherent jobs, and jobs with one thing broken (shapes kept 1-D/2-D so they can be sent)."""
    job = draw(coherent_jobs())
    b = job.batch
    job.submitted_ns = draw(st.integers(0, 2**62))
    how = draw(st.sampled_from(MUTATIONS))
    lane = draw(st.integers(0, b - 1))
    if how == "ctx":
        job.context_lens = job.context_lens.copy()
        job.context_lens[lane] += draw(st.sampled_from([-1, 1, 5]))
    elif how == "flip_valid":
        job.lane_valid = job.lane_valid.copy()
        job.lane_valid[lane] ^= 1
    elif how == "qs_entry" and b > 1:
        job.query_start = job.query_start.copy()
        i = draw(st.integers(1, b - 1))
        job.query_start[i] += draw(st.sampled_from([-2, -1, 1, 2]))
    elif how == "position" and job.positions.size:
        job.positions = job.positions.copy()
        job.positions[draw(st.integers(0, job.positions.size - 1))] += draw(st.sampled_from([-1, 1]))
    elif how == "drop_token" and job.tokens.size:
        job.tokens, job.positions = job.tokens[:-1], job.positions[:-1]
    elif how == "as_decode":
        job.kind = JobKind.DECODE
    elif how == "lane_shape":
        name = draw(st.sampled_from(["context_lens", "sample", "temperature", "top_p", "top_k", "seed",
                                     "want_logprobs"]))
        setattr(job, name, np.concatenate([getattr(job, name), getattr(job, name)[:1]]))
    elif how == "table_rows":
        job.block_tables = job.block_tables[:-1]
    elif how == "qs_start":
        job.query_start = job.query_start.copy()
        job.query_start[0] = 1
    return job


# -- round trip -------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(mutated_jobs())
def test_to_arrays_from_arrays_round_trips_exactly(job):
    assert_same_job(Job.from_arrays(job.to_arrays()), job)


@settings(max_examples=60, deadline=None)
@given(mutated_jobs())
def test_a_job_packed_into_a_ring_record_reads_back_exactly_as_views(job):
    with Ring.create("npuservetest", "records", 1 << 16, tag="j") as ring:  # unlinked on exit
        with ring.reserve(job.array_spec()) as w:
            job.pack_into(w.arrays)
        rec = ring.peek()
        got = Job.from_arrays(rec, copy=False)
        assert_same_job(got, job)
        assert not got.tokens.flags.writeable  # views of the read-only record, not copies
        copied = Job.from_arrays(rec)
        del rec, got
        ring.release()
    assert_same_job(copied, job)  # copies outlive the record


def test_kv_copy_jobs_round_trip():
    job = Job.kv_copy(5, 2, [1, 2, 3], [7, 8, 9])
    assert_same_job(Job.from_arrays(job.to_arrays()), job)


def test_from_arrays_copies_unless_asked_for_views():
    job = build_job(JobKind.DECODE, [Lane([3], 7, [1]), None], batch=2)
    arrays = job.to_arrays()
    copied, viewed = Job.from_arrays(arrays), Job.from_arrays(arrays, copy=False)
    for name in FIELDS:
        assert not any(np.shares_memory(getattr(copied, name), a) for a in arrays.values()), name
    assert np.shares_memory(viewed.tokens, arrays["i32"]) and np.shares_memory(viewed.seed, arrays["u64"])


def test_fields_of_other_dtypes_arrive_in_the_wire_dtypes():
    job = build_job(JobKind.PREFILL, [Lane([5, 6], 0, [2])])
    job.tokens = job.tokens.astype(np.int64)
    job.lane_valid = job.lane_valid.astype(bool)
    job.temperature = job.temperature.astype(np.float64)
    got = Job.from_arrays(job.to_arrays())
    for name in FIELDS:
        assert getattr(got, name).dtype == DTYPES[name], name
        np.testing.assert_array_equal(getattr(got, name), getattr(job, name))


def test_a_field_of_the_wrong_rank_cannot_be_sent():
    job = build_job(JobKind.DECODE, [Lane([3], 7, [1])])
    job.context_lens = job.context_lens.reshape(1, 1)
    with pytest.raises(ValueError, match="context_lens must be 1-D"):
        job.to_arrays()
    job = build_job(JobKind.DECODE, [Lane([3], 7, [1])])
    job.block_tables = job.block_tables.ravel()
    with pytest.raises(ValueError, match="block_tables must be 2-D"):
        job.array_spec()


def test_a_record_whose_sizes_disagree_with_its_meta_is_refused():
    arrays = build_job(JobKind.DECODE, [Lane([3], 7, [1])]).to_arrays()
    arrays["i32"] = arrays["i32"][:-1]
    with pytest.raises(ValueError, match="disagree"):
        Job.from_arrays(arrays)


@pytest.mark.parametrize("with_logits", [False, True])
def test_job_result_round_trips_exactly(with_logits):
    rng = np.random.default_rng(0)
    res = JobResult(job_id=2**40 + 3, generation=9, kind=JobKind.DECODE, status=JobStatus.FAILED,
                    tokens=np.array([4, -1, 7], np.int32), logprobs=np.array([-0.5, 0, -2.25], np.float32),
                    logits=rng.standard_normal((3, 11)).astype(np.float32) if with_logits else None,
                    device_us=1234, worker_us=5678)
    got = JobResult.from_arrays(res.to_arrays())
    assert (got.job_id, got.generation, got.kind, got.status, got.device_us, got.worker_us) == \
        (res.job_id, res.generation, res.kind, res.status, res.device_us, res.worker_us)
    for name in ("tokens", "logprobs"):
        assert getattr(got, name).dtype == getattr(res, name).dtype
        np.testing.assert_array_equal(getattr(got, name), getattr(res, name))
    if with_logits:
        np.testing.assert_array_equal(got.logits, res.logits)
    else:
        assert got.logits is None


# -- validate ----------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(mutated_jobs())
def test_validate_agrees_with_the_lane_loop(job):
    assert verdict(Job.validate, job) == verdict(oracle_validate, job)


@settings(max_examples=50, deadline=None)
@given(coherent_jobs())
def test_validate_accepts_every_job_build_job_makes(job):
    job.validate()


def test_validate_accepts_kv_copy_and_a_mixed_decode_batch():
    Job.kv_copy(1, 0, [1, 2], [3, 4]).validate()
    build_job(JobKind.DECODE, [None, Lane([1], 4, [0]), None, Lane([2], 0, [1])], batch=8).validate()


def _decode4() -> Job:
    return build_job(JobKind.DECODE, [Lane([1], 4, [0]), None, Lane([2], 9, [1]), None])


@pytest.mark.parametrize("breaks, message", [
    (lambda j: setattr(j, "context_lens", np.array([5, 0, 11, 0], np.int32)), "lane 2: context_lens"),
    (lambda j: setattr(j, "lane_valid", np.array([1, 1, 1, 0], np.uint8)), "decode lane 1 must carry exactly one"),
    (lambda j: setattr(j, "lane_valid", np.array([1, 0, 0, 0], np.uint8)), "inactive lane 2 carries tokens"),
    (lambda j: setattr(j, "query_start", np.array([0, 1, 2, 1, 2], np.int32)), "non-decreasing"),
    (lambda j: setattr(j, "query_start", np.array([0, 1, 1, 2], np.int32)), "B\\+1 entries"),
    (lambda j: setattr(j, "positions", j.positions[:1]), "positions and tokens differ"),
    (lambda j: setattr(j, "top_k", j.top_k[:3]), "top_k must have one entry per lane"),
    (lambda j: setattr(j, "block_tables", j.block_tables[:2]), "block_tables must be"),
    (lambda j: setattr(j, "kind", JobKind.KV_COPY) or setattr(j, "src_blocks", np.array([1], np.int32)),
     "src_blocks and dst_blocks"),
])
def test_validate_rejects_each_kind_of_incoherence(breaks, message):
    job = _decode4()
    job.validate()
    breaks(job)
    with pytest.raises(ValueError, match=message):
        job.validate()
    assert verdict(oracle_validate, job) is not None


def test_validate_reports_the_first_bad_lane_whatever_the_check():
    job = _decode4()
    job.context_lens = np.array([9, 0, 10, 0], np.int32)  # lane 0: wrong context
    job.lane_valid = np.array([1, 0, 0, 0], np.uint8)  # lane 2: inactive with a token
    with pytest.raises(ValueError, match="^lane 0: context_lens"):
        job.validate()


def test_validate_does_not_overflow_at_the_int32_limit():
    job = build_job(JobKind.DECODE, [Lane([1], 5, [0])])
    job.positions = np.array([2**31 - 1], np.int32)
    job.context_lens = np.array([-(2**31)], np.int32)  # what an int32 "last position + 1" would wrap to
    with pytest.raises(ValueError, match="context_lens"):
        job.validate()


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_decode_job_is_build_job_of_the_same_lanes(data):
    n = data.draw(st.integers(1, 16))
    batch = data.draw(st.sampled_from([None, 16]))
    width = data.draw(st.sampled_from([None, 8]))
    lanes = [Lane(tokens=[data.draw(st.integers(-1, 1000))], start=data.draw(st.integers(0, 3000)),
                  block_table=data.draw(st.lists(st.integers(0, 4095), max_size=8)),
                  temperature=data.draw(st.sampled_from([0.0, 0.7])), top_p=data.draw(st.sampled_from([0.5, 1.0])),
                  top_k=data.draw(st.integers(0, 50)), seed=data.draw(st.integers(-2**63, 2**64 - 1)),
                  want_logprobs=data.draw(st.booleans())) for _ in range(n)]
    kw = dict(job_id=data.draw(st.integers(0, 2**40)), generation=3, batch=batch, table_width=width,
              decode_steps=data.draw(st.sampled_from([1, 4])), queue_next_step=data.draw(st.booleans()))
    want = build_job(JobKind.DECODE, lanes, **kw)
    got = decode_job([ln.tokens[0] for ln in lanes], [ln.start for ln in lanes], [ln.block_table for ln in lanes],
                     [(ln.temperature, ln.top_p, ln.top_k, ln.seed, ln.want_logprobs) for ln in lanes], **kw)
    assert_same_job(got, want)
    assert (got.decode_steps, got.queue_next_step) == (want.decode_steps, want.queue_next_step)
    for name in FIELDS:
        assert getattr(got, name).dtype == getattr(want, name).dtype, name



def _result_arrays(meta: np.ndarray) -> dict[str, np.ndarray]:
    return {"meta": meta, "tokens": np.array([5], np.int32), "logprobs": np.array([-1.5], np.float32)}


def test_a_result_records_meta_is_one_int64_per_slot_in_wire_order():
    """The wire layout of a result's `meta`, written out by hand: job id, generation, kind, status,
    device_us, worker_us, masks, mask_us, device_start_ns, idle_us (a worker and a daemon agree on it)."""
    res = JobResult(job_id=71, generation=72, kind=JobKind.DECODE, status=JobStatus.INVALID,
                    tokens=np.array([5], np.int32), logprobs=np.array([-1.5], np.float32), device_us=74,
                    worker_us=75, masks=76, mask_us=77, device_start_ns=78, idle_us=79)
    meta = res.to_arrays()["meta"]
    assert meta.dtype == np.dtype("<i8")
    assert meta.tolist() == [71, 72, 2, 2, 74, 75, 76, 77, 78, 79]
    got = JobResult.from_arrays(_result_arrays(meta))
    assert (got.job_id, got.generation, got.kind, got.status, got.device_us, got.worker_us, got.masks,
            got.mask_us, got.device_start_ns, got.idle_us) == (71, 72, JobKind.DECODE, JobStatus.INVALID,
                                                               74, 75, 76, 77, 78, 79)


def test_a_result_meta_without_the_occupancy_slots_reads_as_unknown_occupancy():
    got = JobResult.from_arrays(_result_arrays(np.array([71, 72, 2, 0, 74, 75, 76, 77], np.int64)))
    assert (got.job_id, got.status, got.worker_us, got.masks, got.mask_us) == (71, JobStatus.OK, 75, 76, 77)
    assert (got.device_start_ns, got.idle_us) == (0, -1)
