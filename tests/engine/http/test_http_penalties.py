"""Penalties, logit bias, min_p and min_tokens over HTTP with the official `openai` client, on the default
model (Gemma 3 270M on llama.cpp): OpenAI's fields and vLLM's `extra_body` ones reach the board as the wire
protocol's (the same text as the client library sending them), 400s name the field, and greedy with a
`logit_bias` equals llama.cpp's own server on the same GGUF with the same bias."""

from __future__ import annotations

import openai
import pytest

from engine.client import Client

pytestmark = pytest.mark.integration

ALIAS = "gemma3-270m"
PROMPT = "The capital of France is"
VOCAB = 262144


@pytest.fixture(scope="module")
def board(gemma_front):
    return gemma_front  # the session's Gemma board and front (tests/engine/http/conftest.py)


@pytest.fixture(scope="module")
def oai(board):
    _, front = board
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def lib(board):
    d, _ = board
    with Client(d.endpoint, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def plain(lib):
    """The unbiased greedy answer's tokens (the bias below pushes its first token out)."""
    return lib.generate(PROMPT, max_tokens=8).tokens


def test_openai_fields_and_extra_body_reach_the_board_as_the_wire_fields(oai, lib, plain):
    bias = {str(plain[0]): -100, str(plain[2]): 2.5}
    extra = {"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 6}
    r = oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=10, temperature=0.8, seed=7,
                               frequency_penalty=0.7, presence_penalty=0.4, logit_bias=bias, extra_body=extra)
    want = lib.generate(PROMPT, max_tokens=10, temperature=0.8, seed=7, frequency_penalty=0.7,
                        presence_penalty=0.4, logit_bias=bias, **extra)
    assert r.choices[0].text == want.text and want.tokens[0] != plain[0]
    assert r.usage.completion_tokens == len(want.tokens) >= 6
    chat = dict(model=ALIAS, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=10,
                temperature=0, frequency_penalty=1.5, logit_bias={str(plain[0]): -50}, extra_body={"min_tokens": 4})
    whole = oai.chat.completions.create(**chat).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **chat)
                       if c.choices)
    assert whole == streamed and whole


@pytest.mark.parametrize("kwargs,param", [
    (dict(logit_bias={str(VOCAB): 5}), "logit_bias"),  # past the vocabulary
    (dict(logit_bias={"12": 150}), "logit_bias"),
    (dict(frequency_penalty=3), "frequency_penalty"),
    (dict(extra_body={"min_p": 2}), "min_p"),
    (dict(extra_body={"repetition_penalty": -1}), "repetition_penalty"),
    (dict(extra_body={"min_tokens": 20}), "min_tokens"),  # more than max_tokens
])
def test_out_of_range_values_are_400s_naming_the_field(oai, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=4, **kwargs)
    assert info.value.body["param"] == param, info.value.body
    assert oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text


def test_greedy_with_a_logit_bias_equals_llama_cpp_server(gemma_package, oai, plain):
    from tools.load import llamacpp_server

    # " capital" pushed up: " the capital of the capital of ..." instead of " the capital of the country of
    # France." (a bias whose choices are clear in both engines: their logits differ by a few hundredths, so a
    # near tie, such as " known"/" full" after " the" is banned, may go either way)
    bias = {str(plain[1]): 4.0}
    ours = oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=bias)
    server = llamacpp_server.start(f"{gemma_package}/model.gguf", threads=1, parallel=1, ctx_per_slot=256)
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as theirs:
            want = theirs.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=8, temperature=0,
                                             logit_bias=bias)
            unbiased = theirs.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=8, temperature=0)
    finally:
        assert server.stop() == 0
    assert ours.choices[0].text == want.choices[0].text != unbiased.choices[0].text
