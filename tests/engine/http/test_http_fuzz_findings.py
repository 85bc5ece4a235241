"""Regression tests for what fuzzing the HTTP front's request parsing found (tools/fuzz/http_request.py):
bodies the front accepted and turned into wire requests the daemon refuses, so the client got an
upstream protocol error about a field it never sent instead of the front's 400 naming its own field."""

from __future__ import annotations

import pytest

from engine.http import kv_transfer
from engine.http.openai_error import OpenAIError
from engine.http.openai_request import parse_chat, parse_completion
from ipc.schema import validate_request


@pytest.mark.parametrize("parse, body", [
    (parse_chat, {"messages": [{"role": "user", "content": "q"}], "guided_json": ""}),
    (parse_completion, {"prompt": "x", "guided_json": ""}),
])
def test_an_empty_guided_json_string_is_the_fronts_400(parse, body):
    with pytest.raises(OpenAIError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.param == "guided_json"


def test_a_router_returned_curve_key_outside_z85_is_dropped_not_sent_on():
    ours = {"board": "b", "request": "r", "prompt_len": 3, "endpoint": "tcp://127.0.0.1:9", "curve_key": " " * 40}
    handoff = kv_transfer.handoff_of({"do_remote_prefill": True, kv_transfer.OURS: ours})
    assert "curve_key" not in handoff and handoff["endpoint"] == ours["endpoint"]
    validate_request({"v": 1, "op": "generate", "id": "x", "prompt": [1], "handoff": handoff})


def test_a_model_name_no_alias_can_have_is_404_before_the_upstream_lists_its_models():
    from engine.http.app import Front
    from engine.http.metrics import HttpMetrics

    class Upstream:  # has not said what it serves yet
        models: list = []

        def model_for(self, name):
            return None

    front = Front(Upstream(), metrics=HttpMetrics())
    with pytest.raises(OpenAIError) as e:
        front._served(parse_completion({"model": "org/model name", "prompt": "x"}))
    assert e.value.status == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    assert front._served(parse_completion({"model": "gemma3-270m", "prompt": "x"})) is None
