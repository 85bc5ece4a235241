"""Prompt logprobs and alternatives on Gemma 3 270M, against llama.cpp's own server on the same GGUF."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from conftest import daemon_process, http_front_process

from engine.client import Client

pytestmark = pytest.mark.integration

ALIAS = "gemma3-270m"
TEXT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def gemma_board(gemma_package):
    with daemon_process("llamacpp", extra=["--package", gemma_package],
                        settings={"board.threads_per_chip": 1, "model.alias": ALIAS}) as d, \
            http_front_process(d.endpoint) as front:
        yield d, front


@pytest.fixture(scope="module")
def llama_server(gemma_package):
    from tools.load import llamacpp_server

    s = llamacpp_server.start(f"{gemma_package}/model.gguf", threads=1, parallel=1, ctx_per_slot=256)
    yield s.url
    s.stop()


def _llama_next(url: str, prefix: list[int], forced: int) -> tuple[float, list[int]]:
    """llama.cpp's logprob of `forced` after `prefix` (the prefix evaluated fresh, in one batch) and its top 5.
    A logit bias makes it sample `forced`; its probabilities are of the raw logits (before any sampler)."""
    r = httpx.post(url + "/completion", timeout=120, json={
        "prompt": prefix, "n_predict": 1, "n_probs": 5, "temperature": 0, "cache_prompt": False,
        "logit_bias": [[forced, 100.0]], "post_sampling_probs": False})
    r.raise_for_status()
    [p] = r.json()["completion_probabilities"]
    assert p["id"] == forced
    return p["logprob"], [t["id"] for t in p["top_logprobs"]]


def test_echo_logprobs_max_tokens_0_equal_llama_cpp_server(gemma_board, llama_server):
    d, front = gemma_board
    with Client(d.endpoint, timeout=120) as lib:
        wire = lib.generate(TEXT, max_tokens=0, prompt_logprobs=5)
    pl = wire.prompt_logprobs
    ids = pl["tokens"]
    assert wire.tokens == [] and wire.finish_reason == "length" and wire.usage["completion_tokens"] == 0
    assert pl["logprobs"][0] is None and len(pl["logprobs"]) == len(ids) == wire.usage["prompt_tokens"]
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai:
        r = oai.completions.create(model=ALIAS, prompt=TEXT, echo=True, logprobs=1, max_tokens=0)
    [ch] = r.choices
    assert ch.text == TEXT and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    assert ch.logprobs.token_logprobs[0] is None and len(ch.logprobs.token_logprobs) == len(ids)
    for j in range(1, len(ids)):
        lp, top5 = _llama_next(llama_server, ids[:j], ids[j])
        assert abs(ch.logprobs.token_logprobs[j] - lp) < 1e-3, (j, ch.logprobs.token_logprobs[j], lp)
        assert abs(pl["logprobs"][j] - lp) < 1e-3
        assert [i for i, _ in pl["top_logprobs"][j]] == top5, j
        assert len(ch.logprobs.top_logprobs[j]) >= 1


def test_chat_and_completion_top_logprobs_streamed_and_not(gemma_board, llama_server):
    d, front = gemma_board
    with Client(d.endpoint, timeout=120) as lib:
        wire = lib.generate(TEXT, max_tokens=4, top_logprobs=5)
    assert len(wire.top_logprobs) == len(wire.tokens) == 4
    for k, (t, lp, top) in enumerate(zip(wire.tokens, wire.logprobs, wire.top_logprobs)):
        assert top[0][0] == t and math.isclose(top[0][1], lp, abs_tol=1e-6)  # greedy: the chosen is the top
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai:
        r = oai.completions.create(model=ALIAS, prompt=TEXT, max_tokens=4, temperature=0, logprobs=5)
        chunks = list(oai.completions.create(model=ALIAS, prompt=TEXT, max_tokens=4, temperature=0, logprobs=5,
                                             stream=True))
        c = oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                        temperature=0, logprobs=True, top_logprobs=3)
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                        top_logprobs=21)
        assert e.value.body["param"] == "top_logprobs"
    [ch] = r.choices
    assert [len(t) for t in ch.logprobs.top_logprobs] == [5, 5, 5, 5] or all(1 <= len(t) <= 5
                                                                             for t in ch.logprobs.top_logprobs)
    streamed = [lp for k in chunks if k.choices and k.choices[0].logprobs for lp in k.choices[0].logprobs.top_logprobs]
    assert streamed == ch.logprobs.top_logprobs
    assert all(len(e.top_logprobs) == 3 for e in c.choices[0].logprobs.content)
    # llama.cpp's top 5 after the prompt: the first generated token's alternatives
    ids = wire.prompt_logprobs if wire.prompt_logprobs else None
    assert ids is None
