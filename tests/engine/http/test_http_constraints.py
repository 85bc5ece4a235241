"""Structured output and chat on the default model (Gemma 3 270M on llama.cpp) through the official client.

The front runs without --chat-template: the package has none, so chat uses
llama.cpp's built-in `gemma` format. Every completed constrained output must
parse and validate (`jsonschema` as the independent checker).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.integration

ALIAS = "gemma3-270m"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                      "continent": {"enum": ["Europe", "Asia", "Africa", "America",
                                                                             "Oceania"]}},
                    "required": ["name", "continent"], "additionalProperties": False},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "country", "languages"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe Paris as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def board(gemma_front):
    return gemma_front


@pytest.fixture(scope="module")
def oai(board):
    _, front = board
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
        yield c


def _parallel(fn, args):
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(fn, args))


def test_chat_works_on_the_default_model_with_its_familys_built_in_template(board, oai):
    _, front = board
    models = httpx.get(front.url + "/v1/models", timeout=30).json()["data"]
    assert models[0]["chat_template"].startswith("llama.cpp built-in 'gemma'")
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital?"}]
    rendered = httpx.post(front.url + "/v1/chat/completions/render", json={"model": ALIAS, "messages": msgs},
                          timeout=60).json()
    assert rendered["prompt"].startswith("<start_of_turn>user\nAnswer briefly.\n\nWhat is the capital?<end_of_turn>")
    assert rendered["prompt"].endswith("<start_of_turn>model\n")
    r = oai.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.usage.prompt_tokens == len(rendered["token_ids"])
    assert rendered["token_ids"].count(105) == 2  # <start_of_turn> as the control token, not as text
    assert "chat template: llama.cpp built-in 'gemma'" in front.log()


def test_json_schema_and_json_object_greedy_and_sampled_always_validate(oai):
    def ask(case):
        kind, temperature, seed = case
        fmt = RESPONSE_FORMAT if kind == "schema" else {"type": "json_object"}
        r = oai.chat.completions.create(model=ALIAS, messages=ASK, response_format=fmt, max_tokens=120,
                                        temperature=temperature, seed=seed)
        return kind, r.choices[0]

    # Six: one round of the eight parallel lanes; more would only add a second round of the same checks.
    cases = [("schema", 0.0, 0), ("object", 0.0, 0)] + [("schema", 1.0, s) for s in range(3)] \
        + [("object", 1.0, 0)]
    done = 0
    for kind, ch in _parallel(ask, cases):
        if ch.finish_reason == "length":  # max_tokens inside the constraint: incomplete, as OpenAI does
            continue
        assert ch.finish_reason == "stop"
        value = json.loads(ch.message.content)
        if kind == "schema":
            jsonschema.validate(value, SCHEMA)
        else:
            assert isinstance(value, dict)
        done += 1
    assert done >= len(cases) // 2


def test_regex_and_grammars_through_the_peers_fields(oai):
    date = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    gbnf = 'root ::= answer "." \nanswer ::= "yes" | "no"'
    lark = 'start: "The answer is " NUM\nNUM: /[0-9]{1,3}/'

    def ask(case):
        extra, seed = case
        r = oai.completions.create(model=ALIAS, prompt="Today's date is", max_tokens=24, temperature=1.0, seed=seed,
                                   extra_body=extra)
        return extra, r.choices[0]

    ok_schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                 "additionalProperties": False}
    cases = [({"guided_regex": date}, s) for s in range(3)] + [
        ({"grammar": gbnf}, 1), ({"guided_grammar": lark}, 2), ({"guided_json": ok_schema}, 3)]
    for extra, ch in _parallel(ask, cases):
        assert ch.finish_reason == "stop", (extra, ch)
        if "guided_regex" in extra:
            assert re.fullmatch(date, ch.text), ch.text
        elif "grammar" in extra:
            assert ch.text in ("yes.", "no.")
        elif "guided_grammar" in extra:
            assert re.fullmatch(r"The answer is [0-9]{1,3}", ch.text), ch.text
        else:
            assert isinstance(json.loads(ch.text)["ok"], bool)


def test_bad_constraints_are_400s_naming_the_problem_and_neighbours_are_untouched(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=ALIAS, messages=ASK, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    assert "objectx" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=ALIAS, prompt="x", max_tokens=8, extra_body={"grammar": "root ::= ("})
    assert "gbnf" in str(info.value)
    # the daemon keeps serving
    r = oai.completions.create(model=ALIAS, prompt="x", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


def test_unconstrained_lanes_beside_constrained_ones_give_their_solo_tokens(board, gemma_package):
    """llama.cpp's rule, as in test_daemon_llamacpp: identical to the solo run but for its near-ties."""
    import asyncio

    from engine.async_client import AsyncClient
    from workers.llamacpp.binding import LlamaModel
    from workers.llamacpp.solo import compare_greedy, greedy_solo
    from workers.llamacpp.tokenizer import GgufTokenizer

    d, _ = board
    gguf = f"{gemma_package}/model.gguf"
    tok = GgufTokenizer(gguf)
    prompts = [tok.encode(t) for t in ("The capital of France is", "Once upon a time", "def fibonacci(n):")]
    tok.close()

    async def run():
        async with AsyncClient(d.endpoint, timeout=300) as c:
            plain = [c.generate(p, max_tokens=16, temperature=0.0, ignore_eos=True) for p in prompts]
            constrained = [c.generate("JSON:", max_tokens=32, temperature=1.0, seed=i,
                                      constraint={"kind": "json_object", "body": ""}) for i in range(3)]
            return await asyncio.gather(*plain, *constrained)

    results = asyncio.run(run())
    ref = LlamaModel(gguf, n_ctx=512, n_batch=512, n_seq_max=1, n_threads=1)
    try:
        solo = [greedy_solo(ref, p, 16) for p in prompts]
    finally:
        ref.close()
    verdicts = [compare_greedy(r.tokens, want, gaps) for r, (want, gaps) in zip(results, solo)]
    assert "differs" not in verdicts, verdicts
    assert all(r.text.startswith("{") for r in results[3:])
