"""Alternatives and prompt logprobs from a real ref-backend daemon: streamed equals whole, alone equals in a
batch with requests that ask nothing, max_tokens 0, and a backend that cannot is refused."""

from __future__ import annotations

import threading

import pytest
from daemon_procs import daemon_process

from engine.client import Client, ClientError

PROMPT = [256] + [(11 * i) % 250 + 1 for i in range(1, 30)]


@pytest.fixture(scope="module")
def ref_daemon():
    with daemon_process("ref") as d:
        yield d


def test_streamed_equals_whole_and_alone_equals_beside_other_requests(ref_daemon):
    ask = dict(max_tokens=6, temperature=0.8, seed=4, top_logprobs=3, prompt_logprobs=2)
    with Client(ref_daemon.endpoint, timeout=120) as c:
        whole = c.generate(PROMPT, **ask)
        sink: list = []
        list(c.stream(PROMPT, result=sink, **ask))
    streamed = sink[0]
    assert streamed.tokens == whole.tokens and streamed.logprobs == whole.logprobs
    assert streamed.top_logprobs == whole.top_logprobs and streamed.prompt_logprobs == whole.prompt_logprobs
    assert len(whole.top_logprobs) == 6 and all(len(t) == 3 for t in whole.top_logprobs)
    pl = whole.prompt_logprobs
    assert pl["tokens"] == PROMPT and pl["logprobs"][0] is None and len(pl["logprobs"]) == len(PROMPT)
    assert all(len(t) == 2 for t in pl["top_logprobs"][1:])
    # the same request beside plain ones (mixed jobs, other lanes) gives the same answer
    results: dict = {}

    def run(key, prompt, **kw):
        with Client(ref_daemon.endpoint, timeout=120) as c:
            results[key] = c.generate(prompt, **kw)

    threads = [threading.Thread(target=run, args=("asked", PROMPT), kwargs=ask)] + [
        threading.Thread(target=run, args=(i, PROMPT[:10 + i]), kwargs=dict(max_tokens=8, seed=i))
        for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = results["asked"]
    # the same tokens and alternatives; the values within the ref backend's batching tolerance (its matmuls
    # round differently with other rows beside)
    assert got.tokens == whole.tokens
    assert [[i for i, _ in t] for t in got.top_logprobs] == [[i for i, _ in t] for t in whole.top_logprobs]
    assert [v for t in got.top_logprobs for _, v in t] == pytest.approx(
        [v for t in whole.top_logprobs for _, v in t], abs=1e-4)
    assert got.prompt_logprobs["logprobs"][1:] == pytest.approx(whole.prompt_logprobs["logprobs"][1:], abs=1e-4)
    assert all(results[i].top_logprobs is None and results[i].prompt_logprobs is None for i in range(4))


def test_max_tokens_0_scores_the_prompt_and_0_without_it_is_refused(ref_daemon):
    with Client(ref_daemon.endpoint, timeout=120) as c:
        r = c.generate(PROMPT, max_tokens=0, prompt_logprobs=0)
        assert r.tokens == [] and r.finish_reason == "length" and r.usage["completion_tokens"] == 0
        assert len(r.prompt_logprobs["logprobs"]) == len(PROMPT)
        with pytest.raises(ClientError) as e:
            c.generate(PROMPT, max_tokens=0)
        assert e.value.code == 400 and "max_tokens" in str(e.value)
        with pytest.raises(ClientError) as e:
            c.generate(PROMPT, top_logprobs=21)
        assert e.value.code == 400 and "top_logprobs" in str(e.value)
        assert c.generate(PROMPT, max_tokens=1).tokens  # the board keeps serving
