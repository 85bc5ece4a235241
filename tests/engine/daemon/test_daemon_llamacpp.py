"""A real daemon on the `llamacpp` backend (tiny model as GGUF) against llama.cpp run alone in-process.

Rule for "the same tokens" (llama.cpp's kernels may round differently per
batch shape): identical, except that a request may diverge at a position
where the solo run's top-2 logit gap is below `TOP2_EPSILON`; such cases
are counted and printed (`-s` shows them), and every other difference fails.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.async_client import AsyncClient
from workers.llamacpp.binding import LlamaModel
from workers.llamacpp.solo import TOP2_EPSILON, compare_greedy, greedy_solo
from workers.default_package import ensure_default_gguf_package
from workers.package_loader import load_package

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def solo():
    pkg = load_package(ensure_default_gguf_package())
    model = LlamaModel(pkg.gguf_path, n_ctx=512, n_batch=512, n_seq_max=1, n_threads=1)
    yield lambda prompt, n: greedy_solo(model, prompt, n)
    model.close()


def _requests(n: int, seed: int, prefix_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [256] + [rng.randrange(256) for _ in range(prefix_len - 1)]
    out = []
    for i in range(n):
        if i % 2:
            out.append(shared + [rng.randrange(256) for _ in range(rng.randrange(1, 9))])
        else:
            out.append([256] + [rng.randrange(256) for _ in range(rng.randrange(1, 40))])
    return out


def _run_concurrently(endpoint: str, prompts: list[list[int]], max_tokens: int) -> list:
    async def run():
        async with AsyncClient(endpoint, timeout=180) as c:
            return await asyncio.gather(*(c.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                                          for p in prompts))
    return asyncio.run(run())


def _check(results, prompts, solo, max_tokens) -> dict:
    verdicts = {"same": 0, "near-tie": 0, "differs": 0}
    bad = []
    for i, (p, r) in enumerate(zip(prompts, results)):
        want, gaps = solo(p, max_tokens)
        v = compare_greedy(r.tokens, want, gaps)
        verdicts[v] += 1
        if v == "differs":
            bad.append((i, r.tokens, want))
    print(f"\nbatched vs alone (top-2 epsilon {TOP2_EPSILON}): {verdicts}")
    assert not bad, bad[:3]
    return verdicts


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-batches", "separate-jobs"])
def test_16_concurrent_greedy_requests_give_the_tokens_each_gives_alone(daemon, solo, mixed):
    d = daemon(backend="llamacpp", chips=1, settings={"board.threads_per_chip": 1, "batch.mixed_batches": mixed})
    prompts = _requests(17, seed=7)
    first = _run_concurrently(d.endpoint, prompts[1:2], 24)  # puts the shared prefix into the prefix cache
    results = first + _run_concurrently(d.endpoint, prompts[:1] + prompts[2:], 24)
    verdicts = _check(results, prompts[1:2] + prompts[:1] + prompts[2:], solo, 24)
    assert verdicts["same"] >= 15
    assert sum(r.usage["cached_tokens"] == 32 for r in results[1:]) == 7  # the shared 40-token prefix, 2 blocks
    with d.client(timeout=10) as c:
        counters = c.stats()["scheduler"]["counters"]
    if mixed:  # every job mixed, and some carried several prompts
        assert counters["mixed_jobs"] > 0 and "decode_jobs" not in counters
        assert counters["prefill_lanes"] > counters["prefill_jobs"], counters
    else:
        assert "mixed_jobs" not in counters and counters["decode_jobs"] > 0


def test_prefix_reuse_preemption_and_resume_equal_recomputing(daemon, solo):
    # 20 blocks of 16 = 320 KV cells for 12 sequences of up to 88 tokens: the scheduler must preempt,
    # and a preempted request is resumed by recomputing (partly from the prefix cache).
    d = daemon(backend="llamacpp", chips=1, settings={"kv.num_blocks": 20, "board.threads_per_chip": 1})
    prompts = _requests(13, seed=11)
    results = _run_concurrently(d.endpoint, prompts[1:2], 40)
    results += _run_concurrently(d.endpoint, prompts[:1] + prompts[2:], 40)
    _check(results, prompts[1:2] + prompts[:1] + prompts[2:], solo, 40)
    with d.client(timeout=10) as c:
        counters = c.stats()["scheduler"]["counters"]
    assert counters["preemptions"] > 0, counters
    assert counters["mixed_jobs_decode_and_prefill"] > 0, counters  # recomputed prompts beside decode lanes
    assert any(r.usage["cached_tokens"] for r in results)
