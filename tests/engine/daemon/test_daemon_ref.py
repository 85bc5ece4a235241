"""The 2-chip `ref` daemon against the ref backend run alone in-process: same prompt + seed, same tokens."""

from __future__ import annotations

import asyncio
import random

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
    reqs = _workload(200)

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
