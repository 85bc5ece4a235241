"""The HTTP load driver: request bodies, stream tallies and error codes (pure), then `npuserve bench --openai`
against llama.cpp's own HTTP server on the Gemma package."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT
from tools.load.openai_load import BAD_EVENT, CUT_OFF, OpenAIDriver, StreamTally, base_url, completion_body, error_code
from tools.load.report import summarize
from tools.load.runner import Record, run_loop
from tools.load.sse import SseEvent


def _ev(obj) -> SseEvent:
    return SseEvent("message", obj if isinstance(obj, bytes) else orjson.dumps(obj))


def _chunk(text, reason=None, **extra):
    return {"choices": [{"index": 0, "text": text, "finish_reason": reason}], **extra}


def test_load_clients_run_on_uvloop():
    """Every load client process (HTTP and ZeroMQ alike) runs on uvloop, as the front does."""

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_loop(loop_module()).startswith("uvloop")


def test_base_url_and_body():
    assert base_url("http://h:1/v1/") == base_url("http://h:1/") == "http://h:1"
    r = {"index": 3, "tenant": "a", "prompt": [5, 6], "text": None,
         "fields": {"max_tokens": 7, "seed": 3, "ignore_eos": True, "tenant": "a"}}
    assert completion_body(r, "m") == {"prompt": [5, 6], "max_tokens": 7, "stream": True, "temperature": 0.0,
                                       "stream_options": {"include_usage": True}, "model": "m", "user": "a",
                                       "seed": 3, "ignore_eos": True}
    body = completion_body({**r, "text": "hi", "fields": {"max_tokens": 2, "temperature": 0.7}}, None)
    assert body["prompt"] == "hi" and body["temperature"] == 0.7 and "model" not in body and "user" not in body


def test_tally_times_content_events_and_takes_usage_for_the_token_count():
    t = StreamTally(sent=10.0)
    t.on_event(_ev(_chunk("a")), 10.5)
    t.on_event(_ev(_chunk("bcd")), 10.6)  # a server that coalesces: one event, several tokens
    t.on_event(_ev(_chunk("", "length")), 10.7)  # llama.cpp's closing event carries no text: not content
    t.on_event(_ev({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}}), 10.7)
    t.on_event(_ev(b"[DONE]"), 10.8)
    t.finish()
    assert t.error is None and t.finish_reason == "length" and t.events == 2 and t.tokens == 4
    assert (t.first, t.last) == (10.5, 10.6) and t.gaps_ms == [pytest.approx(100.0)]
    rec = Record(*t.row(1, "default"))
    assert rec.ttft_ms == pytest.approx(500.0) and rec.tpot_ms == pytest.approx(100 / 3) and rec.itl_ms == t.gaps_ms


def test_tally_without_usage_counts_events_and_reads_chat_deltas():
    t = StreamTally(sent=0.0)
    t.on_event(_ev({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}), 0.1)
    t.on_event(_ev({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}), 0.2)
    t.on_event(_ev({"choices": [{"index": 0, "delta": {"content": "y"}, "finish_reason": "stop"}]}), 0.3)
    t.on_event(_ev(b"[DONE]"), 0.3)
    t.finish()
    assert t.first == 0.2 and t.tokens == 2 and t.finish_reason == "stop" and t.error is None


@pytest.mark.parametrize("events, code", [
    ([_chunk("a")], CUT_OFF),  # no [DONE]: cut off
    ([_chunk("a"), b"not json", b"[DONE]"], BAD_EVENT),
    ([{"error": {"code": 504, "message": "deadline", "type": "timeout"}}, b"[DONE]"], 504),
    ([{"error": {"code": "rate_limited", "message": "x"}}, b"[DONE]"], 500),
])
def test_tally_errors(events, code):
    t = StreamTally(sent=0.0)
    for i, e in enumerate(events):
        t.on_event(_ev(e), float(i))
    t.finish()
    assert t.error == code


def test_error_code_from_bodies():
    assert error_code({"error": {"code": 429, "message": "busy"}}, 429) == 429
    assert error_code({"error": {"code": "401"}}, 401) == 401
    assert error_code({"error": {"code": "invalid_api_key"}}, 401) == 401  # OpenAI's own string codes
    assert error_code({}, 503) == 503 and error_code({}, 200) == 500


def test_summary_pools_itl_gaps():
    recs = [Record(0, "default", 0.0, 0.1, 0.3, 3, None, [100.0, 100.0]),
            Record(1, "default", 0.0, 0.1, 0.7, 3, None, [100.0, 500.0]),
            Record(2, "default", 0.0, None, None, 0, 503, [])]
    row = summarize(recs)
    assert row["itl_p50_ms"] == 100.0 and row["itl_p99_ms"] == 500.0 and row["errors"] == 1
    assert "itl_p50_ms" not in summarize([Record(0, "default", 0.0, 0.1, 0.2, 2, None)])


@pytest.fixture(scope="module")
def llama_server(gemma_package):
    from tools.load import llamacpp_server

    s = llamacpp_server.start(f"{gemma_package}/model.gguf", threads=1, parallel=4, ctx_per_slot=256, api_key="k1")
    yield s
    assert s.stop() == 0


@pytest.mark.integration
def test_bench_openai_against_llama_cpp_server(llama_server):
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "--openai", llama_server.url + "/v1",
                        "--api-key", "k1", "--concurrency", "4", "--requests", "8", "--prompt", "fixed:16", "--output", "fixed:6",
                        "--json", "--no-progress"], cwd=ROOT, capture_output=True, timeout=240)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    row, summary = [orjson.loads(x) for x in p.stdout.splitlines()]
    assert row["kind"] == "row" and row["label"] == "openai" and summary["errors"] == 0
    # ignore_eos and the server's own usage: exactly the workload's 8 x 6 tokens (kept-alive connections the
    # server closed after a stream were retried, not counted as failures)
    assert row["requests"] == 8 and row["errors"] == 0 and row["generated_tokens"] == 48
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["itl_p50_ms"] > 0 and row["tpot_p50_ms"] > 0


@pytest.mark.integration
def test_bad_key_fails_before_the_run_and_a_refused_request_is_recorded_by_its_code(llama_server):
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "--openai", llama_server.url, "--api-key", "bad",
                        "--requests", "2", "--json", "--no-progress"], cwd=ROOT, capture_output=True, timeout=120)
    assert p.returncode != 0 and b"answered 401" in p.stderr and b"--api-key" in p.stderr
    rows = []
    req = {"index": 0, "tenant": "default", "prompt": [5, 6, 7], "text": None, "fields": {"max_tokens": 2}}

    async def one():
        async with OpenAIDriver({"openai": llama_server.url, "api_key": "bad"}) as d:
            await d.one(req, rows.append)
    asyncio.run(one())
    rec = Record(*rows[0])
    assert rec.error == 401 and rec.tokens == 0 and rec.first is None


def test_unreachable_server_says_what_to_do():
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "--openai", "http://127.0.0.1:9", "--json"],
                       cwd=ROOT, capture_output=True, timeout=60)
    assert p.returncode != 0 and b"cannot reach the server" in p.stderr
