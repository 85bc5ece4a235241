"""`n` > 1 and `best_of` over HTTP with the official `openai` client, on a real ref-backend board."""

from __future__ import annotations

import openai
import pytest
from daemon_procs import daemon_process
from http_front_procs import http_front_process

from engine.client import Client
from engine.http.choices import choice_seed

pytestmark = pytest.mark.integration

PROMPT = [256] + [(7 * i) % 250 + 1 for i in range(1, 40)]  # 40 tokens: two full blocks of 16 and a tail


@pytest.fixture(scope="module")
def board():
    with daemon_process("ref") as d, http_front_process(d.endpoint) as front:
        yield d, front


def _find(d, key):
    if isinstance(d, dict):
        if key in d and isinstance(d[key], int):
            return d[key]
        for v in d.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


def test_n_choices_have_their_own_seed_streams_and_count_the_prompt_once(board):
    d, front = board
    fresh = [256] + [(13 * i) % 250 + 1 for i in range(1, 40)]  # a prompt the board has not seen
    with Client(d.endpoint, timeout=120) as lib, \
            openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai:
        hits0 = _find(lib.stats(), "prefix_hit_tokens") or 0
        r = oai.completions.create(prompt=fresh, model=None, n=4, max_tokens=6, temperature=1.0, seed=11,
                                   extra_body={"ignore_eos": True})
        hits = (_find(lib.stats(), "prefix_hit_tokens") or 0) - hits0
        singles = [lib.generate(fresh, max_tokens=6, temperature=1.0, seed=choice_seed(11, k), ignore_eos=True)
                   for k in range(4)]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [s.text for s in singles]  # choice k: the request's seed, derived
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == len(fresh) and r.usage.completion_tokens == 24
    # the prompt computed once: the three siblings started once their leader's prompt was on the chip, and
    # found its two full blocks in the prefix cache (the board's prefix_cache_hits); the leader found nothing
    assert hits == 3 * 32


def test_streamed_choices_carry_their_index_and_equal_the_whole_answer(board):
    _, front = board
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai:
        whole = oai.completions.create(prompt=PROMPT, model=None, n=3, max_tokens=5, temperature=1.0, seed=3)
        chunks = list(oai.completions.create(prompt=PROMPT, model=None, n=3, max_tokens=5, temperature=1.0, seed=3,
                                             stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: "", 2: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    assert chunks[-1].usage.prompt_tokens == len(PROMPT) and chunks[-1].usage.completion_tokens == 15


def test_best_of_returns_the_choices_of_highest_cumulative_logprob(board):
    _, front = board
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai:
        every = oai.completions.create(prompt=PROMPT, model=None, n=4, max_tokens=5, temperature=1.0, seed=5,
                                       logprobs=0)
        picked = oai.completions.create(prompt=PROMPT, model=None, n=2, best_of=4, max_tokens=5, temperature=1.0,
                                        seed=5)
    score = sorted(range(4), key=lambda i: (-sum(every.choices[i].logprobs.token_logprobs), i))[:2]
    assert [c.text for c in picked.choices] == [every.choices[i].text for i in sorted(score)]
    assert [c.index for c in picked.choices] == [0, 1]
    assert picked.usage.completion_tokens == 20 and picked.usage.prompt_tokens == len(PROMPT)


@pytest.mark.parametrize("body, field", [({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 3, "best_of": 2}, "best_of"),
                                         ({"best_of": 2, "stream": True}, "best_of")])
def test_out_of_range_choices_are_400_naming_the_field_and_the_board_keeps_serving(board, body, field):
    _, front = board
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai:
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(prompt=PROMPT, model=None, max_tokens=2, **body)
        assert e.value.body["param"] == field
        assert oai.completions.create(prompt=PROMPT, model=None, max_tokens=1).choices[0].finish_reason


def test_siblings_start_only_after_their_leaders_first_event():
    """The order that makes the prompt computed once: a prompt's siblings are sent when its leader has
    answered (its prompt computed), the next prompt's leader at once."""
    import asyncio

    from engine.http.choices import staggered_batches

    log: list[str] = []

    class Client:
        def stream_batches(self, msg):
            async def gen():
                log.append(f"send {msg['id']}")
                await asyncio.sleep(0)
                log.append(f"first {msg['id']}")
                yield [{"ev": "tokens", "tokens": [1]}]
                yield [{"ev": "done"}]
            return gen()

    async def run():
        msgs = [{"id": f"p{p}c{k}"} for p in range(2) for k in range(3)]
        async for _ in staggered_batches(Client(), msgs, 3):
            pass

    asyncio.run(run())
    for p in range(2):
        first = log.index(f"first p{p}c0")
        assert all(log.index(f"send p{p}c{k}") > first for k in (1, 2)), log
    assert log.index("send p1c0") < log.index("first p0c0")  # leaders do not wait for each other
