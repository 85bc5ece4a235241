"""executor.decode_steps on a real `llamacpp` daemon (tiny model as GGUF, mixed batches on): the same tokens
and text as one step per job, greedy and sampled, with stop strings and max_tokens cutting lanes mid-job.

The requests of a round are sent at once and gathered into one prefill job (the prefill window), so both
daemons see the same lanes together at every position (llama.cpp rounds by batch shape, so the shapes
must match for the tokens to match bit for bit).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.async_client import AsyncClient

pytestmark = pytest.mark.integration

SETTINGS = {"board.threads_per_chip": 1, "batch.prefill_window_us": 200_000}


def _requests(seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(8):
        prompt = [256] + [rng.randrange(32, 127) for _ in range(12)]  # one length: one prefill shape
        out.append(dict(prompt=prompt, max_tokens=[7, 10, 13, 18][i % 4], seed=100 + i, ignore_eos=True,
                        temperature=0.0 if i % 2 == 0 else 0.9, top_k=0 if i % 4 < 2 else 40))
    return out


def _run(endpoint: str, reqs: list[dict]) -> list:
    async def one(c: AsyncClient, r: dict):
        sink: list = []
        toks: list[int] = []
        async for chunk in c.stream(r["prompt"], result=sink, **{k: v for k, v in r.items() if k != "prompt"}):
            toks.extend(chunk)
        res = sink[0]
        assert toks == res.tokens  # nothing streamed past the end
        return res.tokens, res.text, res.finish_reason

    async def run():
        async with AsyncClient(endpoint, timeout=120) as c:
            return await asyncio.gather(*(one(c, r) for r in reqs))
    return asyncio.run(run())


def _with_stops(reqs: list[dict], results: list) -> list[dict]:
    """Each request again with a stop string: a character of its free-running text a few tokens in."""
    out = []
    for r, (_, text, _) in zip(reqs, results):
        pick = next((ch for ch in text[2:] if ch.isascii() and ch.isprintable()), None)
        out.append(dict(r, stop=[pick]) if pick else r)
    return out


def test_multi_step_decode_gives_the_tokens_of_one_step_per_job(daemon):
    one = daemon(backend="llamacpp", settings={**SETTINGS, "executor.decode_steps": 1})
    many = daemon(backend="llamacpp", settings={**SETTINGS, "executor.decode_steps": 4})
    plain = _requests(5)
    ref = _run(one.endpoint, plain)
    stopped = _with_stops(plain, ref)
    assert sum("stop" in r for r in stopped) >= 6
    ref_stop = _run(one.endpoint, stopped)
    assert sum(reason == "stop" for _, _, reason in ref_stop) >= 4
    got = _run(many.endpoint, plain)
    got_stop = _run(many.endpoint, stopped)
    assert got == ref
    assert got_stop == ref_stop
    with one.client(timeout=10) as c:
        base = c.stats()["scheduler"]["counters"]
    with many.client(timeout=10) as c:
        counters = c.stats()["scheduler"]["counters"]
    assert "multi_step_jobs" not in base and base.get("failed_jobs", 0) == 0
    assert counters["multi_step_jobs"] >= 6 and counters["multi_step_tokens_dropped"] > 0, counters
    assert counters.get("failed_jobs", 0) == 0 and counters["mixed_jobs"] >= 2, counters
