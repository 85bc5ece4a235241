"""Penalties, logit bias, min_p and min_tokens through real daemons, against the NumPy reference
(tests/penalty_reference.py) run on the model's own logits: alone and among 16 concurrent streams with plain
ones beside them, with queued next steps on, and with n-gram speculation on (penalised lanes take neither;
the plain ones keep them), after a balancer-style resume and after a requeue off a dead worker, and with
multi-step decode on the reference chip library's device loop and its preemptions; out-of-range values are
400s naming the field."""

from __future__ import annotations

import asyncio

import pytest

from chip_faults import frozen_then_killed
from daemon_procs import daemon_process
from engine.async_client import AsyncClient
from engine.errors import InvalidRequest
from penalty_reference import ModelSteps, Params
from workers.backends.ref import RefBackend
from workers.oracle import Oracle

pytestmark = pytest.mark.integration

EOS = {257}
REPEAT = [ord(c) for c in "the cat sat on the mat. the cat sat on the mat. the cat"]  # n-gram drafts find matches

PENALISED = [  # (prompt, max_tokens, Params): every parameter, greedy and seeded, with and without top-k
    (REPEAT, 24, Params(frequency_penalty=1.2)),
    (REPEAT, 24, Params(presence_penalty=1.5, temperature=0.9, seed=11)),
    (REPEAT, 24, Params(repetition_penalty=1.4)),
    (REPEAT[:20], 24, Params(repetition_penalty=0.8, temperature=1.0, seed=3, top_k=30)),
    ([72, 105], 20, Params(logit_bias=((101, 8.0), (257, -100.0)))),
    ([72, 105], 20, Params(logit_bias=((111, 5.0),), temperature=1.2, seed=8)),
    ([1, 2, 3], 20, Params(min_p=0.2, temperature=1.5, seed=21)),
    ([1, 2, 3], 20, Params(min_tokens=12, temperature=1.0, seed=5)),
    ([9, 9, 9, 9], 30, Params(frequency_penalty=-0.5, presence_penalty=0.5, repetition_penalty=1.1, min_p=0.05,
                              min_tokens=3, temperature=0.8, seed=99, logit_bias=((33, 2.0),))),
    (REPEAT, 24, Params(frequency_penalty=2.0, temperature=0.7, seed=1, top_k=5)),
]
PLAIN = [  # beside them: the plain sampler, queued next steps, n-gram drafts
    (REPEAT, 24, dict(temperature=0.0)), (REPEAT, 24, dict(temperature=0.8, top_p=0.9, seed=4)),
    (REPEAT[:30], 24, dict(temperature=1.0, top_k=20, seed=6)), ([5, 6, 7], 20, dict(temperature=0.0)),
    ([5, 6, 7], 20, dict(temperature=0.7, seed=9)), (REPEAT, 30, dict(temperature=0.0)),
]


@pytest.fixture(scope="module")
def board():
    with daemon_process("ref", chips=2, settings={
            "recovery.heartbeat_timeout_ms": 120_000, "executor.queue_next_step": True}) as d:
        yield d


@pytest.fixture(scope="module")
def model() -> ModelSteps:
    be = RefBackend()
    be.load(None)
    return ModelSteps(be)


def _gather(d, reqs: list[tuple[list[int], int, dict]]) -> list:
    async def run():
        async with AsyncClient(d.endpoint, timeout=120) as c:
            return await asyncio.gather(*(c.generate(p, max_tokens=n, **kw) for p, n, kw in reqs))
    return asyncio.run(run())


def test_sixteen_concurrent_streams_and_each_alone_equal_the_reference(board, model):
    oracle = Oracle()
    reqs = [(p, n, prm.wire()) for p, n, prm in PENALISED] + PLAIN
    got = _gather(board, reqs)
    for (prompt, n, prm), r in zip(PENALISED, got):
        want = model.run(prompt, n, prm, EOS)
        assert (r.tokens, r.finish_reason) == want, prm
    for (prompt, n, kw), r in zip(PLAIN, got[len(PENALISED):]):
        assert (r.tokens, r.finish_reason) == oracle.run(prompt, n, **kw), kw
    with board.client(timeout=60) as c:
        for (prompt, n, prm), r in zip(PENALISED, got):
            assert c.generate(prompt, max_tokens=n, **prm.wire()).tokens == r.tokens  # alone
        counters = c.stats()["scheduler"]["counters"]
    assert counters["queued_steps"] > 0 and counters.get("failed_jobs", 0) == 0, counters  # the mode was on
    assert len(got[7].tokens) >= 12  # min_tokens: EOS held off while fewer than 12


def test_penalised_lanes_beside_speculating_ones_equal_the_reference(daemon, model):
    """n-gram speculation on: the plain greedy lanes verify drafts (in jobs the penalised lanes share, one
    token each), and every stream equals the reference or the oracle."""
    d = daemon(backend="ref", settings={"speculative.method": "ngram", "speculative.max_draft_tokens": 4})
    pen = PENALISED[:4]
    plain = [(REPEAT, 30, dict(temperature=0.0)), (REPEAT[:40], 30, dict(temperature=0.0))]
    got = _gather(d, [(p, n, prm.wire()) for p, n, prm in pen] + plain)
    for (prompt, n, prm), r in zip(pen, got):
        assert (r.tokens, r.finish_reason) == model.run(prompt, n, prm, EOS), prm
    oracle = Oracle()
    for (prompt, n, kw), r in zip(plain, got[len(pen):]):
        assert (r.tokens, r.finish_reason) == oracle.run(prompt, n, **kw)
    with d.client(timeout=30) as c:
        stats = c.stats()["scheduler"]
    assert stats["speculative"]["num_drafts"] > 0 and stats["counters"].get("failed_jobs", 0) == 0, stats


def test_a_resumed_stream_continues_exactly(board, model):
    """A balancer resuming a broken stream sends the tokens so far as `continuation`: the worker rebuilds the
    counts from the prompt and them."""
    prompt, n, prm = PENALISED[8]
    with board.client(timeout=60) as c:
        whole = c.generate(prompt, max_tokens=n, **prm.wire())
        first = c.generate(prompt, max_tokens=7, **prm.wire())
        rest = c.generate(prompt, max_tokens=n, continuation=first.tokens, **prm.wire())
    assert first.tokens == whole.tokens[:7]
    assert first.tokens + rest.tokens == whole.tokens
    assert model.run(prompt, n, prm, EOS, continuation=first.tokens)[0] == rest.tokens


def test_penalised_requests_requeued_off_a_dead_worker_continue_exactly(board):
    d = board
    reqs = PENALISED[:6]
    with d.client(timeout=60) as c:
        fault_free = [c.generate(p, max_tokens=n, **prm.wire()).tokens for p, n, prm in reqs]
        victim = d.health()["chips"][0]["pid"]
        with frozen_then_killed(c, victim):
            results: list = [[] for _ in reqs]
            streams = [c.stream(p, max_tokens=n, result=results[i], **prm.wire())
                       for i, (p, n, prm) in enumerate(reqs)]
        got = [[t for chunk in s for t in chunk] for s in streams]
        counters = c.stats()["scheduler"]["counters"]
    assert got == fault_free and counters.get("requeued", 0) > 0


def test_min_tokens_holds_off_a_stop_sequence_the_output_reaches_early(board):
    with board.client(timeout=60) as c:
        plain = c.generate(REPEAT, max_tokens=12, ignore_eos=True).tokens
        stop = [[plain[1]]]
        early = c.generate(REPEAT, max_tokens=12, ignore_eos=True, stop=stop)
        held = c.generate(REPEAT, max_tokens=12, ignore_eos=True, stop=stop, min_tokens=6)
    assert early.tokens == plain[:1] and early.finish_reason == "stop"
    later = [i for i in range(6, 12) if plain[i] == plain[1]]  # the first match after 6 tokens ends it
    want = (plain[:later[0]], "stop") if later else (plain, "length")
    assert (held.tokens, held.finish_reason) == want


@pytest.mark.parametrize("fields,field,reason", [
    ({"min_p": 2}, "min_p", "out_of_range"),
    ({"presence_penalty": -2.5}, "presence_penalty", "out_of_range"),
    ({"frequency_penalty": "1"}, "frequency_penalty", "bad_type"),
    ({"repetition_penalty": 0}, "repetition_penalty", "out_of_range"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "out_of_range"),
    ({"logit_bias": {"five": 1}}, "logit_bias", "bad_type"),
    ({"logit_bias": {"320": 1}}, "logit_bias", "token_out_of_range"),  # past the model's vocabulary
    ({"min_tokens": 9}, "min_tokens", "invalid_min_tokens"),  # more than max_tokens
])
def test_out_of_range_values_are_400s_naming_the_field_and_the_board_keeps_serving(board, fields, field, reason):
    with board.client(timeout=60) as c:
        with pytest.raises(InvalidRequest) as info:
            c.generate([1, 2, 3], max_tokens=8, **fields)
        assert info.value.reason == reason and info.value.args[0].startswith(f"{field}:"), str(info.value)
        assert len(c.generate([1, 2, 3], max_tokens=4, ignore_eos=True, **Params(min_p=0.1).wire()).tokens) == 4


def test_a_backend_that_samples_on_the_device_refuses_penalties_naming_the_parameter(daemon):
    d = daemon(backend="stub", chips=1)
    with d.client(timeout=30) as c:
        for fields, name in (({"frequency_penalty": 0.5}, "frequency_penalty"), ({"logit_bias": {"1": 3}}, "logit_bias"),
                             ({"min_tokens": 2}, "min_tokens"), ({"min_p": 0.1}, "min_p")):
            with pytest.raises(InvalidRequest) as info:
                c.generate([1, 2, 3], max_tokens=4, **fields)
            assert info.value.reason == f"{name}_unsupported"
        assert len(c.generate([1, 2, 3], max_tokens=4, presence_penalty=0.0, logit_bias={}).tokens) == 4  # neutral


def test_multi_step_decode_on_the_device_loop_and_preemption_keep_penalised_lanes_equal_to_the_reference(
        daemon, tmp_path):
    """executor.decode_steps = 4 on the reference chip library: penalised lanes run multi-step jobs in its
    device loop (its C port of the penalties), beside plain ones. 20 KV blocks of 16 for 12 sequences of up
    to ~70 tokens: the scheduler preempts, and a preempted request re-prefills its prompt and output, from
    which the worker rebuilds its counts. Every penalised stream equals the reference on the library's
    logits."""
    from workers.backends.ctypes_backend import CtypesBackend, build_reference_library

    library = str(build_reference_library(tmp_path))
    trace = tmp_path / "loop.trace"
    d = daemon(backend="ctypes", settings={"model.ctypes_library": library, "executor.decode_steps": 4,
                                           "kv.num_blocks": 20, "admission.max_waiting_requests": 64},
               env={"REF_LOOP_TRACE": str(trace)})
    pen = [(p[:30], 40, prm) for p, _, prm in PENALISED[:8]]
    alone = _gather(d, [(p, n, dict(prm.wire(), ignore_eos=True)) for p, n, prm in pen[:2]])
    assert trace.exists() and len(trace.read_text().splitlines()) > 0  # penalised lanes only: the device loop ran
    reqs = [(p, n, dict(prm.wire(), ignore_eos=True)) for p, n, prm in pen] + \
        [(p, 40, dict(kw, ignore_eos=True)) for p, _, kw in PLAIN[:4]]
    got = _gather(d, reqs)
    with d.client(timeout=30) as c:
        counters = c.stats()["scheduler"]["counters"]
    assert counters["multi_step_jobs"] > 0 and counters["preemptions"] > 0, counters
    assert counters.get("failed_jobs", 0) == 0, counters
    backend = CtypesBackend(library=library, block_size=16, num_blocks=64)
    backend.load(None)
    lib_model = ModelSteps(backend)
    for (prompt, n, prm), r in zip(pen, got):
        assert (r.tokens, r.finish_reason) == lib_model.run(prompt, n, prm, set()), prm
    assert [r.tokens for r in alone] == [r.tokens for r in got[:2]]


def test_the_cli_generate_flags_send_the_penalties(board):
    import subprocess
    import sys

    import orjson

    from repo_root import ROOT

    prompt, n, prm = PENALISED[8]
    cmd = [sys.executable, "-m", "tools.cli", "generate", "--endpoint", board.endpoint, "--json",
           "--prompt-tokens", ",".join(map(str, prompt)), "--max-tokens", str(n), "--temperature", "0.8",
           "--seed", "99", "--frequency-penalty", "-0.5", "--presence-penalty", "0.5", "--repetition-penalty", "1.1",
           "--min-p", "0.05", "--min-tokens", "3", "--logit-bias", "33=2"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    with board.client(timeout=60) as c:
        assert orjson.loads(r.stdout)["tokens"] == c.generate(prompt, max_tokens=n, **prm.wire()).tokens
    bad = subprocess.run(cmd[:-1] + ["33"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "ID=BIAS" in bad.stderr
