"""LoRA on Gemma 3 270M (`llamacpp`): npuserve against llama.cpp's own server selecting the adapter per request.

Two adapters made by `make-lora` (llama.cpp's LoRA GGUF) and the base model
are requested at once; each answer must be its solo greedy run (llama.cpp
alone with that adapter set, `workers.llamacpp.solo`), and where that run has
no near-tie, the text llama.cpp's server gives with `--lora` and the request's
`lora` selection.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.async_client import AsyncClient
from llama_server_reference import llama_server_texts
from workers.llamacpp.binding import LlamaModel
from workers.llamacpp.solo import compare_greedy, greedy_solo
from workers.llamacpp.tokenizer import GgufTokenizer
from workers.lora.maker import make_lora

pytestmark = pytest.mark.integration

PROMPT = "The capital of France is"
MAX_TOKENS = 8


def test_two_adapters_and_the_base_at_once_each_get_llama_cpps_own_answer(daemon, gemma_package, tmp_path):
    gguf = f"{gemma_package}/model.gguf"
    loras = [make_lora(gemma_package, str(tmp_path / f"g{i}"), rank=8, targets=["wq", "wv"], seed=i, strength=0.3)
             for i in (1, 2)]
    tok = GgufTokenizer(gguf)
    prompt = tok.encode(PROMPT)
    d = daemon(backend="llamacpp", chips=1, settings={"board.threads_per_chip": 1, "model.alias": "gemma3-270m"},
               extra=["--package", gemma_package, "--lora", f"g1={loras[0]}", "--lora", f"g2={loras[1]}"])
    kw = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def run():
        async with AsyncClient(d.endpoint, timeout=300) as c:
            return await asyncio.gather(c.generate(prompt, **kw), c.generate(prompt, adapter="g1", **kw),
                                        c.generate(prompt, model="g2", **kw))

    results = asyncio.run(run())
    model = LlamaModel(gguf, n_ctx=512, n_batch=512, n_seq_max=1, n_threads=1)
    try:
        solo = [greedy_solo(model, prompt, MAX_TOKENS)]
        for path in loras:
            ad = model.lora_load(f"{path}/adapter.gguf")
            model.lora_set(ad)
            solo.append(greedy_solo(model, prompt, MAX_TOKENS))
            model.lora_set(None)
    finally:
        model.close()
    verdicts = [compare_greedy(r.tokens, want, gaps) for r, (want, gaps) in zip(results, solo)]
    selections = [[{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}],
                  [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}],
                  [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]]
    server = llama_server_texts(gguf, [{"prompt": prompt, "lora": sel} for sel in selections], MAX_TOKENS,
                                tuple(f"{p}/adapter.gguf" for p in loras))
    texts = [tok.decode(r.tokens) for r in results]
    print(f"\nnpuserve {texts}\nllama.cpp server {server}\nverdicts {verdicts}")
    assert "differs" not in verdicts
    assert len({tuple(w) for w, _ in solo}) == 3  # the adapters change the answer: three different runs
    for v, text, server_text in zip(verdicts, texts, server):
        if v == "same":
            assert text == server_text
    tok.close()
