"""The HTTP front end to end: a real daemon (sim backend), a real `npuserve http`, the official `openai` client."""

from __future__ import annotations

import os
import re
import signal
import socket
import time

import httpx
import openai
import orjson
import pytest
from daemon_procs import daemon_process
from http_front_procs import http_front_process, start_http_front
from repo_root import ROOT
from waiting import wait_until
from prometheus_client.parser import text_string_to_metric_families

from engine.client import Client
from workers.tokenizer import ByteTokenizer

pytestmark = pytest.mark.integration

# A decode step takes 2 ms: a long request is still running when a test hangs up on it.
SIM = {"decode_base_ms": 2.0, "decode_per_lane_ms": 0.0}


@pytest.fixture(scope="module")
def board():
    """One daemon and one open front for the module."""
    with daemon_process("sim", backend_options=SIM) as d, http_front_process(d.endpoint) as front:
        yield d, front


@pytest.fixture(scope="module")
def oai(board):
    _, front = board
    with openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def lib(board):
    d, _ = board
    with Client(d.endpoint, timeout=60) as c:
        yield c


def cancelled_count(c: Client) -> int:
    return c.stats()["scheduler"]["counters"].get("cancelled", 0)


def byte_text(tokens: list[int]) -> list[str]:
    tok = ByteTokenizer(320)
    return [tok.piece(t).decode("utf-8", errors="replace") for t in tokens]


def test_greedy_completion_equals_the_client_library_token_for_token(oai, lib):
    r = oai.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0, logprobs=0)
    ref = lib.generate("Hello", max_tokens=12, logprobs=True)
    [ch] = r.choices
    assert ch.text == ref.text
    assert ch.logprobs.tokens == byte_text(ref.tokens)
    assert ch.logprobs.token_logprobs == pytest.approx(ref.logprobs)
    assert ch.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.usage["prompt_tokens"], 12)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")


def test_token_id_prompts_and_a_list_of_prompts_give_one_choice_each(oai, lib):
    r = oai.completions.create(model="tiny", prompt=[[72, 105], [66, 121, 101]], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for ch, prompt in zip(r.choices, ([72, 105], [66, 121, 101])):
        assert ch.text == lib.generate(prompt, max_tokens=4).text
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 5


def test_stream_concatenates_to_the_whole_text_with_usage_last(oai):
    whole = oai.completions.create(model="tiny", prompt="Stream me", max_tokens=20, temperature=0)
    chunks = list(oai.completions.create(model="tiny", prompt="Stream me", max_tokens=20, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_max_tokens_stop_seed_and_temperature(oai, lib):
    full = oai.completions.create(model="tiny", prompt="abc", max_tokens=16, temperature=0).choices[0].text
    stop = next(ch for ch in full[2:] if ch != "\ufffd")
    r = oai.completions.create(model="tiny", prompt="abc", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    short = oai.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    a = oai.completions.create(model="tiny", prompt="abc", max_tokens=16, temperature=1.0, seed=7)
    b = oai.completions.create(model="tiny", prompt="abc", max_tokens=16, temperature=1.0, seed=7)
    assert a.choices[0].text == b.choices[0].text == lib.generate("abc", max_tokens=16, temperature=1.0,
                                                                  seed=7).text


BAD = [
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "no_stop_trim": True}, "no_stop_trim"),
    ({"prompt": "x", "return_hidden_states": True}, "return_hidden_states"),
    ({"prompt": "x", "skip_special_tokens": False}, "skip_special_tokens"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "logit_bias": {"5": 200}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 4}, "min_tokens"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_requests_get_openai_shaped_400s(board, body, param):
    _, front = board
    r = httpx.post(front.url + "/v1/completions", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"]


def test_not_json_unknown_model_and_prompt_too_long(board, oai):
    _, front = board
    r = httpx.post(front.url + "/v1/completions", content=b"{nope", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:  # the daemon's own check, mapped to a 400
        oai.completions.create(model="tiny", prompt="x", max_tokens=100000)
    assert "max_seq" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # a stream that fails before its first token: still a 400
        list(oai.completions.create(model="tiny", prompt="x", max_tokens=100000, stream=True))


def test_router_fields_with_neutral_values_are_accepted(board):
    _, front = board
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0, "echo": False, "no_stop_trim": False,
            "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}
    r = httpx.post(front.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(front.url + "/v1/completions/render", json=body, timeout=30)
    assert r.status_code == 200 and r.json() == [{"token_ids": [72, 105], "prompt": "Hi"}]
    r = httpx.post(front.url + "/v1/completions/render", json=dict(body, prompt=["Hi", "Yo"]), timeout=30)
    assert [x["token_ids"] for x in r.json()] == [[72, 105], [89, 111]]
    r = httpx.post(front.url + "/tokenize", json={"model": "tiny", "prompt": "Hi"}, timeout=30)
    assert r.json() == {"tokens": [72, 105], "count": 2, "max_model_len": 2048}


def test_chat_on_a_model_without_template_is_a_clear_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "no_chat_template" and "chat template" in e.value.body["message"]


def test_models_health_and_metrics(board, oai):
    _, front = board
    oai.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    status, body = front.get("/health")
    assert status == 200 and b'"ok"' in body
    status, body = front.get("/metrics")
    text = body.decode()
    assert status == 200
    assert 'npuserve:http_requests_total{endpoint="completions",status="200"}' in text
    assert "npuserve:request_success_total" in text  # the upstream daemon's own series
    # docs/http.md lists exactly the front's own series
    ours = {f.name + ("_total" if f.type == "counter" else "") for f in text_string_to_metric_families(text)
            if f.name.startswith("npuserve:http_")}
    with open(os.path.join(ROOT, "docs", "http.md")) as fh:
        documented = set(re.findall(r"^\| `(npuserve:http_[a-z0-9_]+)` \|", fh.read(), re.M))
    assert documented == ours and len(ours) == 6


def test_disconnect_mid_stream_cancels_the_request_upstream(board, lib):
    _, front = board
    before = cancelled_count(lib)
    body = {"model": "tiny", "prompt": "long", "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", front.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
    wait_until(lambda: cancelled_count(lib) == before + 1, timeout=30, what="the stream cancelled upstream")
    wait_until(lambda: lib.stats()["daemon"]["active_requests"] == 0, timeout=30, what="nothing left running")


def test_disconnect_mid_request_cancels_a_non_streamed_request(board, lib):
    _, front = board
    before = cancelled_count(lib)
    host, port = front.url.removeprefix("http://").split(":")
    body = b'{"model": "tiny", "prompt": "long", "max_tokens": 2000, "temperature": 0}'
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: lib.stats()["daemon"]["active_requests"] == 1, timeout=30, what="the request running")
    wait_until(lambda: cancelled_count(lib) == before + 1, timeout=30, what="the request cancelled upstream")


def test_api_keys_map_to_tenants_and_unknown_keys_get_401(board, lib, tmp_path):
    d, _ = board
    keys = tmp_path / "keys"
    keys.write_text("# key tenant\nsk-alpha-0123456789 alpha\n")
    front = start_http_front(d.endpoint, str(tmp_path / "http.log"), ["--api-keys", str(keys)])
    try:
        with openai.OpenAI(base_url=front.url + "/v1", api_key="sk-wrong-000000000", max_retries=0) as bad_key:
            with pytest.raises(openai.AuthenticationError) as e:
                bad_key.completions.create(model="tiny", prompt="x", max_tokens=1)
            assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
        r = httpx.post(front.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=front.url + "/v1", api_key="sk-alpha-0123456789", max_retries=0) as good:
            good.completions.create(model="tiny", prompt="x", max_tokens=3, user="ignored-with-keys")
        assert lib.stats()["scheduler"]["tenant_service_tokens"].get("alpha", 0) > 0
    finally:
        assert front.stop() == 0


def test_user_names_the_tenant_of_an_open_front(oai, lib):
    oai.completions.create(model="tiny", prompt="x", max_tokens=2, user="carol@example.com")
    assert lib.stats()["scheduler"]["tenant_service_tokens"].get("carol_example.com", 0) > 0


def test_upstream_down_gives_503_and_the_front_recovers(daemon, http_front, short_dir):
    endpoint = f"ipc://{short_dir}/up.sock"
    d = daemon(backend="stub", extra=["--endpoint", endpoint])
    front = http_front(endpoint)
    c = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    assert c.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2
    assert d.stop() == 0
    wait_until(lambda: front.get("/health")[0] == 503, timeout=30, what="/health 503")
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert e.value.status_code == 503 and e.value.body["type"] == "service_unavailable_error"
    daemon(backend="stub", extra=["--endpoint", endpoint])
    wait_until(lambda: front.get("/health")[0] == 200, timeout=60, what="/health 200 again")
    deadline = time.monotonic() + 30
    while True:
        try:
            assert c.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2
            break
        except openai.InternalServerError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_several_prompts_stream_as_indexed_choices(oai):
    prompts = ["one", "two", "three"]
    whole = oai.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0)
    texts = ["", "", ""]
    finished = []
    for chunk in oai.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.append(ch.index)
        last = chunk
    assert texts == [c.text for c in whole.choices]
    assert sorted(finished) == [0, 1, 2] and last.usage.completion_tokens == 18


def test_an_upstream_that_stops_answering_ends_streams_in_flight_and_comes_back(daemon, http_front):
    """SIGSTOP: the daemon keeps its socket but answers nothing; the front's heartbeat declares it down."""
    d = daemon(backend="sim", backend_options=SIM)
    front = http_front(d.endpoint)
    body = {"model": "tiny", "prompt": "long", "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", front.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            os.kill(d.pid, signal.SIGSTOP)
            try:
                rest = [line for line in lines if line.startswith("data: ")]
                assert front.get("/health")[0] == 503
            finally:
                os.kill(d.pid, signal.SIGCONT)
    assert rest[-1] == "data: [DONE]"
    err = orjson.loads(rest[-2][len("data: "):])["error"]
    assert err["type"] == "service_unavailable_error" and err["code"] == "upstream_unavailable"
    wait_until(lambda: front.get("/health")[0] == 200, timeout=60, what="/health 200 again")
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0) as c:
        assert c.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("body,code", [
    ({"logprobs": 2}, "top_logprobs_unsupported"),
    ({"echo": True, "logprobs": 0, "max_tokens": 0}, "prompt_logprobs_unsupported"),
    ({"prompt_logprobs": 1}, "prompt_logprobs_unsupported"),
])
def test_logprobs_a_device_sampling_backend_cannot_give_are_400_with_their_code(board, body, code):
    _, front = board
    r = httpx.post(front.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, **body},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == code
    ok = httpx.post(front.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200  # the board keeps serving


def test_a_hang_up_ends_every_choice_of_an_n_request(board, lib):
    _, front = board
    before = cancelled_count(lib)
    body = {"model": "tiny", "prompt": "long", "max_tokens": 2000, "temperature": 1.0, "seed": 1, "n": 3,
            "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", front.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = set()
            for line in r.iter_lines():  # until every choice streams: all three are running upstream
                if line.startswith("data: {"):
                    seen |= {c["index"] for c in orjson.loads(line[6:])["choices"]}
                if seen == {0, 1, 2}:
                    break
    wait_until(lambda: cancelled_count(lib) == before + 3, timeout=30, what="every choice cancelled upstream")
    wait_until(lambda: lib.stats()["daemon"]["active_requests"] == 0, timeout=30, what="nothing left running")
