"""`n` on the wire, on the `ref` daemon: each choice is its seeded n = 1 request, the prompt computed once."""

from __future__ import annotations

import pytest

from engine.http.choices import choice_seed  # the front's derivation: the wire gives the same choices
from engine.errors import ClientError
from workers.oracle import Oracle

pytestmark = pytest.mark.integration

PROMPT = list(range(40, 90))  # 50 tokens: three full 16-token blocks and a 2-token partial one


def test_n3_choices_are_the_seeded_n1_requests_and_share_the_prompt(daemon):
    oracle = Oracle()
    d = daemon(backend="ref", chips=1)
    with d.client(timeout=120) as c:
        before = c.stats()["scheduler"]["counters"]
        results = c.generate_choices(PROMPT, 3, max_tokens=6, seed=11, temperature=0.9)
        after = c.stats()["scheduler"]["counters"]
        with pytest.raises(ClientError) as e:
            c.generate_choices(PROMPT, 17, max_tokens=1)
    assert (e.value.code, e.value.reason) == (400, "out_of_range") and "n:" in str(e.value)
    for k, r in enumerate(results):
        assert r.tokens == oracle.run(PROMPT, 6, 0.9, seed=choice_seed(11, k))[0], k
        assert r.finish_reason == "length"
    assert [r.usage["cached_tokens"] for r in results] == [0, 48, 48]
    # the prompt once, then per other choice only its partial last block
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(PROMPT) + 2 * (len(PROMPT) - 48)
