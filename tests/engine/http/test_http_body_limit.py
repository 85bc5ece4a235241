"""The front refuses bodies over MAX_BODY_BYTES with an OpenAI-shaped 413, declared or streamed, and keeps serving."""

from __future__ import annotations

import httpx
import pytest
from daemon_procs import daemon_process
from http_front_procs import http_front_process

from engine.http.app import MAX_BODY_BYTES

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def front():
    with daemon_process("stub") as d, http_front_process(d.endpoint) as f:
        yield f


def _assert_413(r: httpx.Response) -> None:
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "body_too_large" and str(MAX_BODY_BYTES) in err["message"]


def _serves(front) -> None:
    r = httpx.post(front.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read(front):
    body = b'{"model": "tiny", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    _assert_413(httpx.post(front.url + "/v1/completions", content=body, timeout=60,
                           headers={"content-type": "application/json"}))
    _serves(front)


def test_a_chunked_body_growing_over_the_limit_is_refused(front):
    def chunks():  # no content-length: the front counts what arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'"}'

    _assert_413(httpx.post(front.url + "/v1/completions", content=chunks(), timeout=60))
    _serves(front)
