"""Penalised sampling in the worker against the NumPy reference (tests/penalty_reference.py): the job record's
penalty arrays, the counts a rebuild lane carries and a decode lane advances, every parameter alone and mixed
in a batch of 16 beside plain lanes, and a retried or rebuilt state."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ipc.lane_penalties import JobPenalties, LanePenalty
from ipc.records import Job, JobKind, Lane, build_job
from penalty_reference import Params, reference_token
from workers.lane_sampling import sample_lanes
from workers.penalties import PenaltyBook, PenaltyError

V = 512
EOS = 3


def _params(rng: random.Random) -> Params:
    """One lane's parameters: each penalty on or off, greedy or seeded, with or without top-k."""
    return Params(
        temperature=rng.choice([0.0, 0.7, 1.0, 1.5]), top_k=rng.choice([0, 0, 1, 20]), seed=rng.randrange(1 << 40),
        presence_penalty=rng.choice([0.0, 1.5, -0.5]), frequency_penalty=rng.choice([0.0, 0.8, -1.0]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.7]), min_p=rng.choice([0.0, 0.05, 0.3]),
        min_tokens=rng.choice([0, 0, 5]),
        logit_bias=tuple(sorted({rng.randrange(V): rng.choice([-100.0, -3.0, 4.5, 100.0]) for _ in range(3)}.items()))
        if rng.random() < 0.5 else (),
    )


def _lane_penalty(key: int, p: Params, prompt, output, rebuild: bool) -> LanePenalty:
    done = len(output)
    return LanePenalty(key, done, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p,
                       p.min_tokens, rebuild, list(prompt) + list(output) if rebuild else (),
                       [i for i, _ in p.logit_bias] if rebuild else (),
                       [b for _, b in p.logit_bias] if rebuild else (), [EOS] if rebuild else ())


def _logits(rng: np.random.Generator, b: int) -> np.ndarray:
    z = rng.normal(0, 3, (b, V)).astype(np.float32)
    z[:, EOS] += 6  # EOS likely: min_tokens must hold it off
    return z


def _wire(job: Job) -> Job:
    return Job.from_arrays(job.to_arrays())


def _run_lanes(lanes: list[Lane], logits: np.ndarray, book: PenaltyBook, kind=JobKind.PREFILL) -> np.ndarray:
    job = _wire(build_job(kind, lanes))
    tokens = np.full(job.batch, -1, np.int32)
    lps = np.zeros(job.batch, np.float32)
    sample_lanes(job, logits, np.arange(job.batch), tokens, lps, penalties=book)
    return tokens


def test_the_penalty_arrays_survive_the_wire_and_bad_ones_are_refused():
    p = Params(presence_penalty=0.5, logit_bias=((7, 2.0), (9, -1.0)), min_tokens=2)
    lanes = [Lane([1, 2, 3], 0, [0], penalty=_lane_penalty(11, p, [1, 2], [3], True)), Lane([4], 0, [1]),
             Lane([5, 6], 0, [2], penalty=_lane_penalty(12, p, [5], [6], False))]
    job = build_job(JobKind.PREFILL, lanes)
    back = _wire(job)
    back.validate()
    pen = back.penalties
    assert pen.active.tolist() == [1, 0, 1] and pen.rebuild.tolist() == [1, 0, 0] and pen.key.tolist() == [11, 0, 12]
    assert pen.lane_history(0).tolist() == [1, 2, 3] and pen.lane_history(2).tolist() == []
    assert [a.tolist() for a in pen.lane_bias(0)] == [[7, 9], [2.0, -1.0]] and pen.lane_stop_ids(0).tolist() == [EOS]
    assert build_job(JobKind.PREFILL, [Lane([1], 0, [0])]).penalties is None  # plain jobs carry none
    arrays = job.to_arrays()
    arrays["pen_i32"] = arrays["pen_i32"][:-1]
    with pytest.raises(ValueError):
        Job.from_arrays(arrays)
    bad = _wire(job)
    bad.penalties.min_p[0] = 2.0
    with pytest.raises(ValueError, match="out of range"):
        bad.validate()


def test_a_batch_of_16_mixed_lanes_samples_what_the_reference_samples_step_after_step():
    """16 lanes, each penalty on or off, beside plain lanes; a prefill then decode steps whose input token is
    the lane's last sample (the book counts it once); each lane's token equals the reference's, and equals
    the token it samples alone."""
    rng = random.Random(5)
    nrng = np.random.default_rng(5)
    n = 16
    params = [_params(rng) if i % 4 != 3 else None for i in range(n)]  # every fourth lane plain (greedy)
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 12))] for _ in range(n)]
    outputs: list[list[int]] = [[] for _ in range(n)]
    book = PenaltyBook()
    for step in range(12):
        logits = _logits(nrng, n)
        lanes = []
        for i in range(n):
            pos = len(prompts[i]) + len(outputs[i])
            toks = prompts[i] if step == 0 else [outputs[i][-1]]
            start = 0 if step == 0 else pos - 1
            p = params[i]
            pen = None if p is None else _lane_penalty(100 + i, p, prompts[i], outputs[i], step == 0)
            base = p or Params()
            lanes.append(Lane(toks, start, [i], True, base.temperature, 1.0, base.top_k, base.seed, False,
                              penalty=pen))
        got = _run_lanes(lanes, logits, book, JobKind.PREFILL if step == 0 else JobKind.DECODE)
        for i in range(n):
            p = params[i] or Params()
            want = reference_token(logits[i], prompts[i], outputs[i], p, len(prompts[i]) + len(outputs[i]), [EOS])
            assert got[i] == want, (step, i, p)
            if step in (0, 7) and params[i] is not None:  # alone in a job of its own, from a fresh book
                alone = _run_lanes([Lane(list(prompts[i]) + outputs[i], 0, [0], True, p.temperature, 1.0, p.top_k,
                                         p.seed, False, penalty=_lane_penalty(1, p, prompts[i], outputs[i], True))],
                                   logits[i:i + 1], PenaltyBook())
                assert alone[0] == want
        for i in range(n):
            outputs[i].append(int(got[i]))
    assert sum(o.count(EOS) for o, p in zip(outputs, params) if p and p.min_tokens) < 16  # min_tokens held EOS off


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.0), ("frequency_penalty", 1.0), ("repetition_penalty", 1.8), ("logit_bias", ((7, 30.0),)),
    ("min_p", 0.5), ("min_tokens", 4),
])
def test_each_parameter_alone_changes_the_greedy_or_seeded_token_as_the_reference_does(field, value):
    nrng = np.random.default_rng(1)
    prompt, output = [7, 8, 9], [7, 7, 20]
    changed = 0
    for temperature in (0.0, 1.0):
        for seed in range(20):
            p = Params(temperature=temperature, seed=seed, **{field: value})
            logits = _logits(nrng, 1)
            lane = Lane(prompt + output, 0, [0], True, temperature, 1.0, 0, seed, False,
                        penalty=_lane_penalty(1, p, prompt, output, True))
            got = int(_run_lanes([lane], logits, PenaltyBook())[0])
            assert got == reference_token(logits[0], prompt, output, p, 6, [EOS])
            changed += got != reference_token(logits[0], prompt, output, Params(temperature=temperature, seed=seed),
                                              6, [EOS])
    assert changed > 0  # the parameter really acts on these rows


def test_a_retried_job_counts_its_input_once_and_a_lost_state_fails_the_job():
    p = Params(frequency_penalty=2.0)
    book = PenaltyBook()
    nrng = np.random.default_rng(2)
    _run_lanes([Lane([1, 2], 0, [0], penalty=_lane_penalty(5, p, [1, 2], [], True))], _logits(nrng, 1), book)
    dec = [Lane([9], 2, [0], penalty=_lane_penalty(5, p, [1, 2], [9], False))]
    logits = _logits(nrng, 1)
    first = _run_lanes(dec, logits, book, JobKind.DECODE)
    again = _run_lanes(dec, logits, book, JobKind.DECODE)  # the same job once more (a retry)
    assert first[0] == again[0] == reference_token(logits[0], [1, 2], [9], p, 3)
    with pytest.raises(PenaltyError, match="no penalty state"):
        _run_lanes([Lane([9], 2, [0], penalty=_lane_penalty(6, p, [1, 2], [9], False))], logits, book,
                   JobKind.DECODE)
    with pytest.raises(PenaltyError, match="counted"):  # a step skipped: the counts would be wrong
        _run_lanes([Lane([4], 4, [0], penalty=_lane_penalty(5, p, [1, 2], [9, 4, 4], False))], logits, book,
                   JobKind.DECODE)


def test_job_penalties_build_pads_missing_lanes():
    jp = JobPenalties.build([None, LanePenalty(3, 0)], 4)
    jp.validate(4)
    assert jp.active.tolist() == [0, 1, 0, 0] and jp.history_start.tolist() == [0, 0, 0, 0, 0]


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    from workers.backends.ctypes_backend import build_reference_library

    return str(build_reference_library(tmp_path_factory.mktemp("penalties")))


LOOP_PARAMS = [Params(frequency_penalty=1.5, presence_penalty=0.5), Params(repetition_penalty=1.6, temperature=1.0, seed=4),
               Params(min_tokens=7, min_p=0.2, temperature=1.4, seed=9, logit_bias=((42, 6.0), (43, -100.0))),
               Params(temperature=0.9, top_k=8, seed=2, frequency_penalty=-1.0), None, Params(temperature=0.8, seed=6)]
LOOP_PROMPTS = [[5, 6, 5, 6], [9] * 7, [1, 2, 3], [77, 78], [10, 11, 12], [200]]


@pytest.mark.parametrize("loop", ["device", "host"])
def test_multi_step_jobs_equal_the_reference_on_the_device_loop_and_on_the_host_loop(library, loop, tmp_path,
                                                                                      monkeypatch):
    """A prefill, a 4-step and a 3-step decode job and a one-step job of six lanes (four penalised, two plain):
    the reference chip library's device loop (its C port of the penalties) and the worker's host loop (a
    library without the device loop) both give each lane the reference's tokens."""
    from penalty_reference import ModelSteps
    from workers.backends.ctypes_backend import CtypesBackend
    from workers.execute_job import execute_job

    trace = tmp_path / "loop.trace"
    monkeypatch.setenv("REF_LOOP_TRACE", str(trace))
    chip = CtypesBackend(library=library, chip_id=0, block_size=16, num_blocks=64, device_loop=loop == "device")
    chip.load(None)
    ref = CtypesBackend(library=library, chip_id=1, block_size=16, num_blocks=64)
    ref.load(None)
    eos = 257
    book = PenaltyBook()
    n = len(LOOP_PROMPTS)
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(n)]
    outputs: list[list[int]] = [[] for _ in range(n)]

    def lanes_at(first: bool) -> list[Lane]:
        out = []
        for i, (prompt, p) in enumerate(zip(LOOP_PROMPTS, LOOP_PARAMS)):
            base = p or Params()
            done = len(outputs[i])
            pen = None if p is None else LanePenalty(
                i + 1, done, base.presence_penalty, base.frequency_penalty, base.repetition_penalty, base.min_p,
                base.min_tokens, first, list(prompt) if first else (), [t for t, _ in base.logit_bias] if first else (),
                [b for _, b in base.logit_bias] if first else (), [eos] if first else ())
            toks, start = (prompt, 0) if first else ([outputs[i][-1]], len(prompt) + done - 1)
            out.append(Lane(toks, start, tables[i], True, base.temperature, 1.0, base.top_k, base.seed, True,
                            penalty=pen))
        return out

    for kind, steps in ((JobKind.PREFILL, 1), (JobKind.DECODE, 4), (JobKind.DECODE, 3), (JobKind.DECODE, 1)):
        job = _wire(build_job(kind, lanes_at(kind is JobKind.PREFILL), decode_steps=steps))
        res = execute_job(chip, job, penalties=book)
        assert res.status.name == "OK", res.error
        toks = res.tokens.reshape(n, -1)
        for i in range(n):
            outputs[i] += toks[i].tolist()
    model = ModelSteps(ref)
    for i, (prompt, p) in enumerate(zip(LOOP_PROMPTS, LOOP_PARAMS)):
        want, _ = model.run(prompt, 9, p or Params(), set(), masked=[eos])
        assert outputs[i] == want, (i, p)
    loops = trace.read_text().splitlines() if trace.exists() else []
    assert len(loops) == (2 if loop == "device" else 0)  # both multi-step jobs ran on the device, or none


def test_a_penalised_lane_beside_drafted_lanes_in_a_verification_job_samples_the_reference():
    """Speculation skips penalised lanes, but their one-token lanes share verification jobs with lanes that
    carry drafts: such a job runs, and the penalised lane samples what the reference samples."""
    from penalty_reference import ModelSteps
    from workers.backends.ref import RefBackend
    from workers.execute_job import execute_job

    chip = RefBackend()
    chip.load(None)
    ref = RefBackend()
    ref.load(None)
    p = Params(frequency_penalty=1.5, repetition_penalty=1.3, temperature=0.9, seed=3)
    pa, pb = [5, 6, 7, 8], [9, 9, 9]
    book = PenaltyBook()
    pen0 = LanePenalty(1, 0, 0.0, 1.5, 1.3, 0.0, 0, True, pb, (), (), ())
    first = execute_job(chip, _wire(build_job(JobKind.PREFILL, [
        Lane(pa, 0, [0, 1]), Lane(pb, 0, [2, 3], True, 0.9, 1.0, 0, 3, False, penalty=pen0)])), penalties=book)
    a0, b0 = first.tokens.tolist()
    pen1 = LanePenalty(1, 1, 0.0, 1.5, 1.3, 0.0, 0, False)
    verify = _wire(build_job(JobKind.PREFILL, [
        Lane([a0, 11, 12], len(pa), [0, 1], drafts=2),
        Lane([b0], len(pb), [2, 3], True, 0.9, 1.0, 0, 3, False, penalty=pen1)]))
    assert verify.draft_lens.tolist() == [2, 0]
    out = execute_job(chip, verify, penalties=book)
    assert out.status.name == "OK", out.error
    assert [b0, int(out.tokens[1])] == ModelSteps(ref).run(pb, 2, p, set())[0]


def test_a_hostile_penalty_record_fails_its_job_and_the_next_one_runs():
    from workers.backends.ref import RefBackend
    from workers.execute_job import execute_job

    chip = RefBackend()
    chip.load(None)
    book = PenaltyBook()
    bad = LanePenalty(1, 0, 0.0, 1.0, 1.0, 0.0, 2, True, [5, 6], [-3], [1.0], [3])
    out = execute_job(chip, _wire(build_job(JobKind.PREFILL, [Lane([5, 6], 0, [0], penalty=bad)])), penalties=book)
    assert out.status.name == "FAILED" and "negative token id" in out.error
    job = _wire(build_job(JobKind.PREFILL, [Lane([5, 6], 0, [0], penalty=bad._replace(bias_ids=[3]))]))
    job.penalties.min_p[0] = 7.0  # out of range on the wire
    assert execute_job(chip, job, penalties=book).status.name == "INVALID"
    good = bad._replace(bias_ids=[3])
    out = execute_job(chip, _wire(build_job(JobKind.PREFILL, [Lane([5, 6], 0, [0], penalty=good)])), penalties=book)
    assert out.status.name == "OK" and len(book) == 1
