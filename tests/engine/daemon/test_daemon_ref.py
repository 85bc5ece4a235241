"""The 2-chip `ref` daemon against the ref backend run alone in-process: same prompt + seed, same tokens."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest

from engine.async_client import AsyncClient
from workers.oracle import Oracle

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    return Oracle()


def _workload(n: int) -> list[dict]:
    rng = random.Random(1234)
    shared = [rng.randrange(256) for _ in range(40)]  # a common 40-token prefix (2 full blocks)
    reqs = []
    for i in range(n):
        if i % 4 == 0:
            prompt = shared + [rng.randrange(256) for _ in range(rng.randrange(1, 8))]
        else:
            prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
        reqs.append(dict(prompt=prompt, max_tokens=rng.randrange(1, 24), seed=rng.randrange(1 << 32),
                         temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([0, 20]),
                         top_p=rng.choice([1.0, 0.9])))
    return reqs


def test_200_concurrent_streams_match_the_ref_backend_alone(daemon, oracle):
    d = daemon(backend="ref", chips=2, settings={"admission.max_waiting_requests": 512})
    _streams_match_the_oracle(d, oracle, _workload(200))


def test_two_jobs_in_flight_per_chip_still_match_the_ref_backend_alone(daemon, oracle):
    d = daemon(backend="ref", chips=2, settings={"admission.max_waiting_requests": 512, "executor.max_inflight": 2})
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:  # the setting must really put two jobs on a chip at once
        with d.client(timeout=10) as c:
            while not stop.is_set():
                seen.extend(ch["inflight"] for ch in c.stats()["scheduler"]["chips"].values())
                time.sleep(0.01)

    t = threading.Thread(target=watch)
    t.start()
    try:
        _streams_match_the_oracle(d, oracle, _workload(80))
    finally:
        stop.set()
        t.join(30)
    assert max(seen) == 2, f"never two jobs in flight on a chip: {sorted(set(seen))}"


def test_queued_next_steps_still_match_the_ref_backend_alone(daemon, oracle):
    """executor.queue_next_step: the worker resolves each queued step's input token from its own sample."""
    d = daemon(backend="ref", chips=2, settings={"admission.max_waiting_requests": 512,
                                                 "executor.queue_next_step": True})
    _streams_match_the_oracle(d, oracle, _workload(80))
    counters = d.client(timeout=10).stats()["scheduler"]["counters"]
    assert counters["queued_steps"] > 100 and counters.get("failed_jobs", 0) == 0, counters


def test_multi_step_decode_still_matches_the_ref_backend_alone(daemon, oracle):
    """executor.decode_steps = 4: the worker runs four steps per decode job; the scheduler cuts each lane at its end."""
    d = daemon(backend="ref", chips=1, settings={"admission.max_waiting_requests": 512, "executor.decode_steps": 4})
    _streams_match_the_oracle(d, oracle, _workload(40))
    counters = d.client(timeout=10).stats()["scheduler"]["counters"]
    assert counters["multi_step_jobs"] > 5 and counters.get("failed_jobs", 0) == 0, counters


def _streams_match_the_oracle(d, oracle, reqs: list[dict]) -> None:

    async def one(c: AsyncClient, r: dict):
        sink: list = []
        toks: list[int] = []
        async for chunk in c.stream(r["prompt"], result=sink, **{k: v for k, v in r.items() if k != "prompt"}):
            toks.extend(chunk)
        return toks, sink[0]

    async def run():
        async with AsyncClient(d.endpoint, timeout=120) as c:
            return await asyncio.gather(*(one(c, r) for r in reqs))

    results = asyncio.run(run())
    mismatches = []
    for i, (r, (toks, res)) in enumerate(zip(reqs, results)):
        want, reason = oracle.run(r["prompt"], r["max_tokens"], r["temperature"], r["top_p"], r["top_k"], r["seed"])
        if toks != want or res.finish_reason != reason:
            mismatches.append((i, toks, res.finish_reason, want, reason))
        assert res.usage["prompt_tokens"] == len(r["prompt"])
        assert res.usage["completion_tokens"] in (len(toks), len(toks) + (reason == "eos"))
    assert not mismatches, mismatches[:3]
    assert all(res.usage["cached_tokens"] % oracle.block_size == 0 for _, res in results)


def test_prefix_sharing_requests_report_cached_tokens_and_same_output(daemon, oracle):
    d = daemon(backend="ref", chips=1)
    prefix = list(range(40, 90))  # 50 tokens: three full blocks of 16
    with d.client(timeout=60) as c:
        first = c.generate(prefix + [1, 2], max_tokens=8, seed=5, temperature=0.8)
    assert first.usage["cached_tokens"] == 0
    assert first.tokens == oracle.run(prefix + [1, 2], 8, 0.8, seed=5)[0]

    # Once the prefix has been prefilled, concurrent requests sharing it reuse its blocks.
    tails = [[3 + i, 4, 5 + i] for i in range(24)]

    async def run():
        async with AsyncClient(d.endpoint, timeout=60) as c:
            return await asyncio.gather(*(c.generate(prefix + t, max_tokens=8, seed=6 + i, temperature=0.8)
                                          for i, t in enumerate(tails)))

    for i, (t, r) in enumerate(zip(tails, asyncio.run(run()))):
        assert r.usage["cached_tokens"] == 48, (i, r.usage)
        assert r.usage["prompt_tokens"] == len(prefix) + len(t)
        assert r.tokens == oracle.run(prefix + t, 8, 0.8, seed=6 + i)[0], i


def _log_softmax64(row: np.ndarray) -> np.ndarray:
    z = row - row.max()
    return z - np.log(np.exp(z).sum())


def test_logprobs_stop_token_ids_and_stop_sequences_through_the_daemon(daemon, oracle):
    """The generate fields that change what comes back, end to end on `ref`:
    greedy logprobs equal a float64 log-softmax of the oracle's logits; a stop
    token id or stop sequence ends the output just before it (never shown),
    streamed or not, with finish_reason "stop"."""
    d = daemon(backend="ref", chips=1)
    prompt = [72, 101, 108, 108, 111, 44, 32]
    logits: list[np.ndarray] = []
    ref, reason = oracle.run(prompt, 24, logits_out=logits, ignore_eos=True)
    assert len(ref) == 24
    want_lp = [float(_log_softmax64(row)[t]) for row, t in zip(logits, ref)]
    k = next(i for i in range(2, 24) if ref[i] not in ref[:i])  # a token first generated at step k
    j = next(i for i in range(2, 23) if all(ref[m:m + 2] != ref[i:i + 2] for m in range(i)))
    with d.client(timeout=60) as c:
        whole = c.generate(prompt, max_tokens=24, logprobs=True, ignore_eos=True)
        chunks: list = []
        sink: list = []
        for ch in c.stream(prompt, max_tokens=24, logprobs=True, ignore_eos=True, result=sink):
            chunks.append(ch)
        by_id = c.generate(prompt, max_tokens=24, ignore_eos=True, stop_token_ids=[ref[k]])
        s2: list = []
        by_seq = [t for ch in c.stream(prompt, max_tokens=24, ignore_eos=True, stop=[ref[j:j + 2]], result=s2)
                  for t in ch]
        sampled = c.generate(prompt, max_tokens=12, logprobs=True, temperature=0.9, seed=4, ignore_eos=True)
    assert whole.tokens == ref and whole.finish_reason == "length"
    np.testing.assert_allclose(whole.logprobs, want_lp, rtol=1e-4, atol=1e-4)
    assert [t for ch in chunks for t in ch] == ref
    np.testing.assert_allclose(sink[0].logprobs, want_lp, rtol=1e-4, atol=1e-4)
    assert (by_id.tokens, by_id.finish_reason) == (ref[:k], "stop")
    assert (by_seq, s2[0].finish_reason) == (ref[:j], "stop")
    assert by_id.usage["completion_tokens"] == k + 1  # the stop token was generated, not shown
    assert len(sampled.logprobs) == len(sampled.tokens) == 12 and all(lp <= 0 for lp in sampled.logprobs)
