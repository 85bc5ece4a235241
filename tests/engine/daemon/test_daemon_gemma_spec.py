"""Gemma 3 270M on llamacpp: greedy text with speculation equals the text without (the Gemma test prompts).

One daemon serves every method, chosen per request: `speculative: "off"`,
the board default `"ngram"`, and `"draft"` with Gemma as its own draft model
(`speculative.draft_package`: the draft-model path on a real model, its own
KV and llama.cpp cells). The rule for "the same tokens" is
`workers.llamacpp.solo.compare_greedy` against llama.cpp run alone:
verification runs k+1 positions in one llama_decode, whose quantized
matmuls may round differently from one-token steps, so a near tie (top-2
gap < its epsilon) may flip, as it may for batched decoding without
speculation.
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


def test_gemma_greedy_with_ngram_and_self_draft_speculation_equals_without(daemon, gemma_package):
    gguf = f"{gemma_package}/model.gguf"
    tok = GgufTokenizer(gguf)
    texts = list(PROMPTS) + [COPY]
    prompts = [tok.encode(t) for t in texts]
    n = MAX_TOKENS + 6
    d = daemon(backend="llamacpp", chips=1, extra=["--package", gemma_package],
               settings={"board.threads_per_chip": 1, "model.alias": "gemma3-270m", "speculative.method": "ngram",
                         "speculative.draft_package": gemma_package})
    kw = dict(max_tokens=n, temperature=0.0, ignore_eos=True)

    async def run():
        async with AsyncClient(d.endpoint, timeout=300) as c:
            async def stats():
                return (await c.stats())["scheduler"]["speculative"]
            off = [await c.generate(p, speculative="off", **kw) for p in prompts]
            ngram = [await c.generate(p, **kw) for p in prompts]
            sp_ngram = await stats()
            draft = [await c.generate(p, speculative="draft", **kw) for p in prompts]
            sp_all = await stats()
            together = await asyncio.gather(*(c.generate(p, **kw) for p in prompts))
            return off, ngram, draft, together, sp_ngram, sp_all

    off, ngram, draft, together, sp_ngram, sp_all = asyncio.run(run())
    model = LlamaModel(gguf, n_ctx=512, n_batch=512, n_seq_max=1, n_threads=1)
    try:
        solo = [greedy_solo(model, p, n) for p in prompts]
    finally:
        model.close()
    print(f"\nngram: {sp_ngram}\nngram + self-draft: {sp_all}")
    for t, a, b, c in zip(texts, off, ngram, draft):
        print(f"{t[:30]!r}: off {a.text!r} | ngram {b.text!r} | draft {c.text!r}")
    verdicts = [compare_greedy(r.tokens, want, gaps) for rs in (off, ngram, draft, together)
                for r, (want, gaps) in zip(rs, solo)]
    assert "differs" not in verdicts, verdicts
    same = [a.tokens == b.tokens == c.tokens for a, b, c in zip(off, ngram, draft)]
    assert sum(same) >= len(same) - verdicts.count("near-tie"), (same, verdicts)
    assert sp_ngram["num_drafts"] > 0 and sp_ngram["num_accepted_tokens"] > 0, sp_ngram
    drafted = sp_all["num_draft_tokens"] - sp_ngram["num_draft_tokens"]
    accepted = sp_all["num_accepted_tokens"] - sp_ngram["num_accepted_tokens"]
    assert drafted > 0 and accepted / drafted > 0.8, (drafted, accepted)  # a model agrees with itself
    tok.close()
