"""`n` on the wire, on the `ref` daemon: each choice is its seeded n = 1 request, the prompt computed once
(the other choices copy its partial last block on the device)."""

from __future__ import annotations

import asyncio

import pytest

from engine.http.choices import choice_seed  # the front's derivation: the wire gives the same choices
from engine.async_client import AsyncClient
from engine.errors import ClientError
from ipc.codec import encode
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
    async def run():
        async with AsyncClient(d.endpoint, timeout=120) as ac:
            return await ac.generate_choices(PROMPT, 3, max_tokens=6, seed=11, temperature=0.9)

    assert [r.tokens for r in asyncio.run(run())] == [r.tokens for r in results]  # the async client's too
    for k, r in enumerate(results):
        assert r.tokens == oracle.run(PROMPT, 6, 0.9, seed=choice_seed(11, k))[0], k
        assert r.finish_reason == "length"
    assert [r.usage["cached_tokens"] for r in results] == [0, 48, 48]
    # the prompt once: the other choices copy its partial last block on the device (ref copies blocks)
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(PROMPT)
    assert after["choices_kv_forked"] - before.get("choices_kv_forked", 0) == 2
    assert after["choices_kv_copy_blocks"] - before.get("choices_kv_copy_blocks", 0) == 2


def test_streamed_choices_carry_their_index_and_one_cancel_ends_them_all(daemon):
    d = daemon(backend="ref", chips=1)
    with d.client(timeout=120) as c:
        one = c.generate(PROMPT, max_tokens=2)  # n = 1: no index anywhere
        c.expect("s")
        c.send_raw(encode({"v": 1, "op": "generate", "id": "s", "prompt": PROMPT, "max_tokens": 2048 - len(PROMPT),
                           "ignore_eos": True, "n": 3}))
        seen: set[int] = set()
        while len(seen) < 3:  # every choice streams (the siblings start once the prompt is computed)
            ev = c.next_event("s")
            assert ev["ev"] == "tokens", ev.get("message")
            seen.add(ev["index"])
        c.cancel("s")
        ends: dict[int, dict] = {}
        while len(ends) < 3:
            ev = c.next_event("s")
            if ev["ev"] != "tokens":
                assert ev["index"] not in ends, ev
                ends[ev["index"]] = ev
    assert "index" not in repr(one)
    assert {k: (e["ev"], e["finish_reason"]) for k, e in ends.items()} == {k: ("done", "cancelled") for k in range(3)}


def test_llamacpp_choices_fork_the_leaders_sequence_and_equal_greedy_alone(daemon):
    """llama.cpp copies no block, but forks a sequence (its cells shared): the choices there take the leader's
    partial last block that way, and each gives the tokens llama.cpp gives the prompt alone."""
    from workers.default_package import ensure_default_gguf_package
    from workers.llamacpp.binding import LlamaModel
    from workers.llamacpp.solo import compare_greedy, greedy_solo
    from workers.package_loader import load_package

    prompt = [256] + PROMPT[1:]  # the tiny GGUF's vocabulary: 320 ids, 256 its BOS
    d = daemon(backend="llamacpp", chips=1, settings={"board.threads_per_chip": 1})
    with d.client(timeout=120) as c:
        before = c.stats()["scheduler"]["counters"]
        results = c.generate_choices(prompt, 3, max_tokens=10, temperature=0.0, ignore_eos=True)
        after = c.stats()["scheduler"]["counters"]
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt)
    assert after["choices_kv_copy_blocks"] - before.get("choices_kv_copy_blocks", 0) == 2
    model = LlamaModel(load_package(ensure_default_gguf_package()).gguf_path, n_ctx=256, n_batch=256, n_seq_max=1,
                       n_threads=1)
    try:
        want, gaps = greedy_solo(model, prompt, 10)
    finally:
        model.close()
    assert all(compare_greedy(r.tokens, want, gaps) != "differs" for r in results), [r.tokens for r in results]
