"""The plumbing of `bench-http-peer --conversations` on the stub backend (no llama.cpp, a few seconds): the
conversation workload over HTTP, both ways of reporting prompt tokens computed, and the paired comparison."""

from __future__ import annotations

from tools.bench.serve.http_peer import CONVERSATION_METRICS, CONVERSATION_TARGETS, parse_args
from tools.load import conversation_http as conv
from tools.load import local_front
from tools.load.paired import compare


def test_prompts_grow_by_answer_and_message_and_fit_the_context():
    spec = conv.ConversationSpec(3, 3, first_len=20, turn_len=5, answer_len=4, seed=1)
    convs = conv.build(spec)
    assert len(convs) == 3 and all(len(c) == 3 for c in convs)
    for c in convs:
        assert [len(p) for p in c] == [20, 29, 38] and c[1][:20] == c[0] and c[2][:29] == c[1]
    assert spec.max_len() == 38 + 4 and conv.build(spec) == convs  # fixed by the seed


def test_prompt_tokens_computed_from_llamacpp_timings_or_openai_usage():
    assert conv.computed_tokens({"timings": {"prompt_n": 7, "cache_n": 93}}, 100) == (7, 93)
    assert conv.computed_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 64}}}, 100) == (36, 64)
    assert conv.computed_tokens({"usage": {"prompt_tokens": 100}}, 100) == (None, None)


def test_conversations_over_the_front_of_a_stub_daemon():
    a = parse_args(["--conversations", "2", "--turns", "2", "--concurrency", "2"])
    assert a.conversations == 2 and a.turns == 2 and a.cache_ram is None
    spec = conv.ConversationSpec(2, 2, first_len=40, turn_len=8, answer_len=3)
    with local_front.daemon_and_front("test", backend="stub", chips=1, settings=[], prefix="npct-") as (_d, front, _m):
        recs = conv.run(front.url, None, conv.build(spec), 2, spec.answer_len)
    assert len(recs) == 4 and all(r["error"] is None and r["ttft_ms"] is not None for r in recs)
    assert all(r["computed"] is not None and r["computed"] + r["cached"] == r["prompt"] for r in recs)
    assert any(r["cached"] > 0 for r in recs if r["turn"] == 1)  # the second turn hits the first's prefix
    s = conv.summarize(recs)
    assert s["requests"] == 4 and s["errors"] == 0 and s["prompt_tokens"] == 40 * 2 + 51 * 2
    rows = [{"label": "npuserve", "round": 1, **s},
            {"label": "llama.cpp", "round": 1, **{**s, "ttft_p50_ms": s["ttft_p50_ms"] * 2}}]
    cmp = {c["metric"]: c for c in compare(rows, "npuserve", "llama.cpp", CONVERSATION_TARGETS,
                                           metrics=CONVERSATION_METRICS)}
    assert cmp["ttft_p50_ms"]["ratio"] == 0.5 and cmp["ttft_p50_ms"]["met"] is True
    assert cmp["prompt_tokens_computed"]["met"] is True  # equal counts: ratio 1.0, at the bound
