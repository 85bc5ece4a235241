"""Gemma 3 270M on llamacpp: greedy text with n-gram speculation equals the text without (the Gemma test prompts).

The rule for "the same tokens" is `workers.llamacpp.solo.compare_greedy`
against llama.cpp run alone: verification runs k+1 positions in one
llama_decode, whose quantized matmuls may round differently from one-token
steps, so a near tie (top-2 gap < its epsilon) may flip, as it may for
batched decoding without speculation.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.async_client import AsyncClient
from workers.llamacpp.binding import LlamaModel
from workers.llamacpp.solo import compare_greedy, greedy_solo
from workers.llamacpp.tokenizer import GgufTokenizer

from test_daemon_gemma import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.integration

COPY = ("Repeat exactly: the quick brown fox jumps over the lazy dog. "
        "Repeat exactly: the quick brown fox jumps over the lazy dog. Repeat exactly:")


def test_gemma_greedy_with_ngram_speculation_equals_without(daemon, gemma_package):
    gguf = f"{gemma_package}/model.gguf"
    tok = GgufTokenizer(gguf)
    texts = list(PROMPTS) + [COPY]
    prompts = [tok.encode(t) for t in texts]
    d = daemon(backend="llamacpp", chips=1, extra=["--package", gemma_package],
               settings={"board.threads_per_chip": 1, "model.alias": "gemma3-270m", "speculative.method": "ngram"})
    kw = dict(max_tokens=MAX_TOKENS + 6, temperature=0.0, ignore_eos=True)

    async def run():
        async with AsyncClient(d.endpoint, timeout=300) as c:
            off = [await c.generate(p, speculative="off", **kw) for p in prompts]
            on = [await c.generate(p, **kw) for p in prompts]
            together = await asyncio.gather(*(c.generate(p, **kw) for p in prompts))
            return off, on, together

    off, on, together = asyncio.run(run())
    with d.client(timeout=10) as c:
        sp = c.stats()["scheduler"]["speculative"]
    model = LlamaModel(gguf, n_ctx=512, n_batch=512, n_seq_max=1, n_threads=1)
    try:
        solo = [greedy_solo(model, p, MAX_TOKENS + 6) for p in prompts]
    finally:
        model.close()
    print(f"\nspeculative: {sp}")
    for t, a, b in zip(texts, off, on):
        print(f"{t[:30]!r}: off {a.text!r} | ngram {b.text!r}")
    verdicts = [compare_greedy(r.tokens, want, gaps) for rs in (off, on, together) for r, (want, gaps) in
                zip(rs, solo)]
    assert "differs" not in verdicts, verdicts
    same = [a.tokens == b.tokens for a, b in zip(off, on)]
    assert sum(same) >= len(same) - verdicts.count("near-tie"), (same, verdicts)
    assert sp["num_drafts"] > 0 and sp["num_accepted_tokens"] > 0, sp
    tok.close()


def test_gemma_drafting_for_itself_gives_the_same_text(daemon, gemma_package):
    """The draft-model path on a real model: Gemma as its own draft (same tokenizer, its own KV and cells)."""
    gguf = f"{gemma_package}/model.gguf"
    tok = GgufTokenizer(gguf)
    prompts = [tok.encode(t) for t in PROMPTS]
    d = daemon(backend="llamacpp", chips=1, extra=["--package", gemma_package],
               settings={"board.threads_per_chip": 1, "model.alias": "gemma3-270m", "speculative.method": "draft",
                         "speculative.draft_package": gemma_package})
    kw = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def run():
        async with AsyncClient(d.endpoint, timeout=300) as c:
            off = [await c.generate(p, speculative="off", **kw) for p in prompts]
            on = [await c.generate(p, **kw) for p in prompts]
            return off, on

    off, on = asyncio.run(run())
    with d.client(timeout=10) as c:
        sp = c.stats()["scheduler"]["speculative"]
    print(f"\nspeculative (self-draft): {sp}")
    model = LlamaModel(gguf, n_ctx=512, n_batch=512, n_seq_max=1, n_threads=1)
    try:
        solo = [greedy_solo(model, p, MAX_TOKENS) for p in prompts]
    finally:
        model.close()
    verdicts = [compare_greedy(r.tokens, want, gaps) for rs in (off, on) for r, (want, gaps) in zip(rs, solo)]
    assert "differs" not in verdicts, verdicts
    assert sp["num_drafts"] > 0 and sp["acceptance_rate"] > 0.8, sp  # a model agrees with itself
    tok.close()
