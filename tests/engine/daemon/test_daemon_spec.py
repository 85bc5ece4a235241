"""Speculative n-gram decoding through the real daemon and ref workers: outputs equal speculation off."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.async_client import AsyncClient

pytestmark = pytest.mark.integration


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    out = []
    for i in range(n):
        motif = [rng.randrange(1, 256) for _ in range(rng.randrange(3, 9))]
        out.append((motif * 8)[: 10 + 3 * i])  # copy-heavy: the output tends to repeat the prompt
    return out


def test_ngram_speculation_equals_plain_decoding_token_for_token(daemon):
    d = daemon(backend="ref", chips=1, settings={"speculative.method": "ngram", "speculative.max_draft_tokens": 4})
    prompts = _prompts(6)
    reqs = []
    for i, p in enumerate(prompts):
        base = dict(max_tokens=24 + i, seed=100 + i, temperature=0.0 if i % 2 == 0 else 0.8, logprobs=True)
        if i == 4:
            base["stop_token_ids"] = [p[3]]
        reqs.append(base)

    async def one(c, p, r, spec):
        res = await c.generate(p, speculative=spec, **r)
        return res.tokens, res.logprobs, res.finish_reason

    async def run(spec, concurrent):
        async with AsyncClient(d.endpoint, timeout=120) as c:
            if concurrent:
                return await asyncio.gather(*(one(c, p, r, spec) for p, r in zip(prompts, reqs)))
            return [await one(c, p, r, spec) for p, r in zip(prompts, reqs)]

    plain = asyncio.run(run("off", False))
    alone = asyncio.run(run(None, False))
    batched = asyncio.run(run(None, True))
    for (pt, plp, pr), (at, alp, ar), (bt, blp, br) in zip(plain, alone, batched):
        assert at == pt and bt == pt and ar == pr and br == pr
        assert alp == pytest.approx(plp, abs=1e-3) and blp == pytest.approx(plp, abs=1e-3)
    with d.client(timeout=10) as c:
        sp = c.stats()["scheduler"]["speculative"]
    assert sp["num_drafts"] > 0 and sp["num_accepted_tokens"] > 0, sp
    kv = None
    with d.client(timeout=10) as c:
        kv = c.stats()["scheduler"]["chips"]
    for chip in kv.values():
        assert chip["kv"]["blocks"]["used"] == 0 and chip["kv"]["blocks"]["quarantined"] == 0


def test_a_draft_model_package_drafts_and_outputs_stay_the_targets(daemon, tmp_path):
    """Target: the built-in tiny model; draft: a make-model package with the same vocabulary (other weights)."""
    from workers.model_maker import make_model

    draft = make_model(str(tmp_path / "draft"), seed=99)
    d = daemon(backend="ref", chips=1, settings={"speculative.method": "draft", "speculative.draft_package": draft})
    prompts = _prompts(4)

    async def run(spec):
        async with AsyncClient(d.endpoint, timeout=120) as c:
            return await asyncio.gather(*(c.generate(p, max_tokens=20, seed=i, temperature=0.0 if i % 2 else 0.9,
                                                     speculative=spec) for i, p in enumerate(prompts)))

    plain, drafted = asyncio.run(run("off")), asyncio.run(run(None))
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]
    with d.client(timeout=10) as c:
        sp = c.stats()["scheduler"]["speculative"]
    assert sp["num_drafts"] > 0, sp
