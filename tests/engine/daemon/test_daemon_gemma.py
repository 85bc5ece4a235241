"""End to end on a real model: Gemma 3 270M on the `llamacpp` backend, against llama.cpp's own server engine.

Each prompt goes both ways: as token ids (tokenized here with GgufTokenizer)
and as `text` (tokenized by the daemon, which also decodes the answer's text,
streamed and not). Greedy decoding; the rule for "the same tokens" is the one
of `workers.llamacpp.solo.compare_greedy`.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.async_client import AsyncClient
from llama_server_reference import llama_server_texts
from workers.llamacpp.binding import LlamaModel
from workers.llamacpp.solo import compare_greedy, greedy_solo
from workers.llamacpp.tokenizer import GgufTokenizer

pytestmark = pytest.mark.integration

PROMPTS = ("The capital of France is", "The three primary colors are")
MAX_TOKENS = 10


def test_gemma_serves_english_and_matches_llama_cpp_server(daemon, gemma_package):
    gguf = f"{gemma_package}/model.gguf"
    tok = GgufTokenizer(gguf)
    prompts = [tok.encode(t) for t in PROMPTS]
    d = daemon(backend="llamacpp", chips=1, extra=["--package", gemma_package],
               settings={"board.threads_per_chip": 1, "model.alias": "gemma3-270m"})

    kw = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def streamed_text(c, text: str):
        res: list = []
        deltas = [delta async for delta in c.stream_text(text, result=res, **kw)]
        return "".join(deltas), res[0]

    async def run():
        async with AsyncClient(d.endpoint, timeout=300) as c:
            by_ids = await asyncio.gather(*(c.generate(p, **kw) for p in prompts))
            # Together again on the same daemon: the round that diverges if the first round's llama.cpp cells
            # linger (the second round's cells then land before its own earlier ones; docs/models.md#correctness).
            by_text = await asyncio.gather(*(c.generate(t, **kw) for t in PROMPTS))
            streamed = [await streamed_text(c, t) for t in PROMPTS]
            return by_ids, by_text, streamed

    results, text_results, streamed = asyncio.run(run())
    for r, rt, (st, sr), ids in zip(results, text_results, streamed, prompts):
        assert rt.usage["prompt_tokens"] == sr.usage["prompt_tokens"] == len(ids)  # the daemon tokenizes alike
        assert r.text == tok.decode(r.tokens) and rt.text == tok.decode(rt.tokens)  # the daemon's decoding
        assert st == sr.text == tok.decode(sr.tokens)  # streamed deltas add up to the whole text
    texts = [tok.decode(r.tokens) for r in results]
    print("\n" + "\n".join(f"{p!r} -> {t!r}" for p, t in zip(PROMPTS, texts)))
    assert "France" in texts[0] and all(t.isascii() and sum(c.isalpha() for c in t) > len(t) // 2 for t in texts)

    model = LlamaModel(gguf, n_ctx=512, n_batch=512, n_seq_max=1, n_threads=1)
    try:
        solo = [greedy_solo(model, p, MAX_TOKENS) for p in prompts]
    finally:
        model.close()
    verdicts = [compare_greedy(r.tokens, want, gaps) for r, (want, gaps) in zip(results, solo)]
    verdicts += [compare_greedy(rt.tokens, want, gaps) for rt, (want, gaps) in zip(text_results, solo)]
    verdicts += [compare_greedy(sr.tokens, want, gaps) for (_, sr), (want, gaps) in zip(streamed, solo)]
    server_texts = llama_server_texts(gguf, [{"prompt": ids} for ids in prompts], MAX_TOKENS)
    print(f"npuserve vs llama.cpp alone: {verdicts}; llama.cpp server: {server_texts}")
    assert "differs" not in verdicts
    for v, text, server_text, (want, gaps) in zip(verdicts, [r.text for r in results + text_results]
                                                  + [sr.text for _, sr in streamed], server_texts * 3, solo * 3):
        if v == "same":
            assert text == server_text  # npuserve's text is llama.cpp's server's text
        else:
            assert tok.decode(want) == server_text or min(gaps) < 0.1
    tok.close()
