"""Prompt logprobs and alternatives on Gemma 3 270M, against llama.cpp's own server on the same GGUF."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from engine.client import Client

pytestmark = pytest.mark.integration

ALIAS = "gemma3-270m"
TEXT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def gemma_board(gemma_front):
    return gemma_front  # the session's Gemma board and front (tests/engine/http/conftest.py)


@pytest.fixture(scope="module")
def llama_server(gemma_package):
    from tools.load import llamacpp_server

    s = llamacpp_server.start(f"{gemma_package}/model.gguf", threads=1, parallel=1, ctx_per_slot=256, swa_full=True)
    yield s.url
    s.stop()


def _llama_next(url: str, prefix: list[int], forced: int) -> tuple[float, list[tuple[int, float]]]:
    """llama.cpp's logprob of `forced` after `prefix` (the prefix evaluated fresh, in one batch) and its top 5
    [(id, logprob)]. A logit bias makes it sample `forced`; its probabilities are of the raw logits."""
    r = httpx.post(url + "/completion", timeout=120, json={
        "prompt": prefix, "n_predict": 1, "n_probs": 5, "temperature": 0, "cache_prompt": False,
        "logit_bias": [[forced, 100.0]], "post_sampling_probs": False})
    r.raise_for_status()
    [p] = r.json()["completion_probabilities"]
    assert p["id"] == forced
    return p["logprob"], [(t["id"], t["logprob"]) for t in p["top_logprobs"]]


def _agree(a: list, b: list, tol: float = 1e-3) -> bool:
    return [i for i, _ in a] == [i for i, _ in b] and all(abs(x - y) < tol for (_, x), (_, y) in zip(a, b))


def test_echo_logprobs_max_tokens_0_equal_llama_cpp_server(gemma_board, llama_server):
    """One logprob per prompt token (the first null), and, wherever the two engines' logits agree, the top-5
    ids of llama.cpp's n_probs and its logprobs within 1e-3.

    llama.cpp's server has no prompt logprobs (it refuses echo), so each position is asked of it as the next
    token after the prefix, a batch of that prefix; the echo request computes the prompt as one batch. On
    this Q4_K_M model the batch's shape alone moves some rows' logits by a few hundredths, so the logprobs
    are compared where the two engines' top-5 logprobs agree, and, at every position, with our own engine
    run on the prefix as llama.cpp ran it (the same batch: the top-5 ids equal and logprobs within 1e-3
    everywhere)."""
    d, front = gemma_board
    with Client(d.endpoint, timeout=120) as lib:
        wire = lib.generate(TEXT, max_tokens=0, prompt_logprobs=5)
        pl = wire.prompt_logprobs
        ids = pl["tokens"]
        same_batch = [lib.generate(ids[:j], max_tokens=1, temperature=0, top_logprobs=5).top_logprobs[0]
                      for j in range(1, len(ids))]
    assert wire.tokens == [] and wire.finish_reason == "length" and wire.usage["completion_tokens"] == 0
    assert pl["logprobs"][0] is None and len(pl["logprobs"]) == len(ids) == wire.usage["prompt_tokens"]
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai:
        r = oai.completions.create(model=ALIAS, prompt=TEXT, echo=True, logprobs=1, max_tokens=0)
    [ch] = r.choices
    assert ch.text == TEXT and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    assert ch.logprobs.token_logprobs[0] is None and len(ch.logprobs.token_logprobs) == len(ids)
    assert ch.logprobs.token_logprobs[1:] == pytest.approx(pl["logprobs"][1:], abs=1e-6)
    agreeing = 0
    for j in range(1, len(ids)):
        lp, top5 = _llama_next(llama_server, ids[:j], ids[j])
        ours = [(i, v) for i, v in pl["top_logprobs"][j]]
        assert _agree(same_batch[j - 1], top5), (j, same_batch[j - 1], top5)
        if _agree(ours, top5):
            agreeing += 1
            assert abs(ch.logprobs.token_logprobs[j] - lp) < 1e-3, (j, ch.logprobs.token_logprobs[j], lp)
    assert agreeing >= (len(ids) - 1) // 2, f"the engines' logits agree at only {agreeing} positions"


def test_top_logprobs_streamed_and_not_over_http(gemma_board):
    d, front = gemma_board
    with Client(d.endpoint, timeout=120) as lib:
        wire = lib.generate(TEXT, max_tokens=4, top_logprobs=5)
    assert len(wire.top_logprobs) == len(wire.tokens) == 4
    for t, lp, top in zip(wire.tokens, wire.logprobs, wire.top_logprobs):
        assert top[0][0] == t and abs(top[0][1] - lp) < 1e-6  # greedy: the chosen token is the most likely
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai:
        r = oai.completions.create(model=ALIAS, prompt=TEXT, max_tokens=4, temperature=0, logprobs=5)
        chunks = list(oai.completions.create(model=ALIAS, prompt=TEXT, max_tokens=4, temperature=0, logprobs=5,
                                             stream=True))
        c = oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                        temperature=0, logprobs=True, top_logprobs=3)
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                        top_logprobs=21)
        assert "top_logprobs" in str(e.value)
        ok = oai.completions.create(model=ALIAS, prompt="x", max_tokens=1)  # the board keeps serving
    assert ok.choices[0].finish_reason == "length"
    [ch] = r.choices
    assert [list(t.values()) for t in ch.logprobs.top_logprobs] == [[v for _, v in top] for top in wire.top_logprobs]
    streamed = [t for k in chunks if k.choices and k.choices[0].logprobs for t in k.choices[0].logprobs.top_logprobs]
    assert streamed == ch.logprobs.top_logprobs
    content = c.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[2].logprob
                           for e in content)


def test_chat_n_choices_streamed_and_not(gemma_board):
    """Chat with n = 2, streamed and not (the tokens themselves are compared on the ref board, whose results
    do not depend on the batch the choices share: test_http_choices.py)."""
    _, front = gemma_board
    msgs = [{"role": "user", "content": "Name a fruit."}]
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai:
        r = oai.chat.completions.create(model=ALIAS, messages=msgs, n=2, max_tokens=5, temperature=1.0, seed=9,
                                        logprobs=True, top_logprobs=2)
        one = oai.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=5, temperature=1.0, seed=9)
        chunks = list(oai.chat.completions.create(model=ALIAS, messages=msgs, n=2, max_tokens=5, temperature=1.0,
                                                  seed=9, stream=True, stream_options={"include_usage": True}))
    assert [c.index for c in r.choices] == [0, 1] and all(c.message.content for c in r.choices)
    assert all(len(e.top_logprobs) == 2 for c in r.choices for e in c.logprobs.content)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    streamed = {0: "", 1: ""}
    ends = {}
    for ch in chunks:
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                ends[c.index] = c.finish_reason
    assert streamed[0] and streamed[1] and set(ends) == {0, 1}
    assert chunks[-1].usage.prompt_tokens == one.usage.prompt_tokens
