"""vLLM's kv_transfer_params (what vllm-router's PD mode sends) mapped to the wire's hand-off, and back."""

from __future__ import annotations

import pytest

from engine.http import kv_transfer
from engine.http.openai_error import OpenAIError
from engine.http.openai_request import parse_chat, parse_completion
from ipc.schema import validate_request

# exactly what vllm-router 0.1.17 sends a prefill worker (its request body, seen by running it)
ROUTER_PREFILL = {"model": "tiny", "prompt": "hello world", "max_tokens": 1, "stream": False, "echo": False,
                  "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                  "return_hidden_states": False, "min_tokens": 1,
                  "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                         "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                         "remote_port": None}}


def wire(req) -> dict:
    msg = {"v": 1, "op": "generate", "id": "w1", "prompt": [1, 2], **req.sampling}
    if req.handoff is not None:
        msg["handoff"] = req.handoff
    return validate_request(msg)


def test_the_routers_prefill_leg_is_an_export_and_its_answer_names_the_handoff():
    req = parse_completion(dict(ROUTER_PREFILL))
    assert req.handoff == {"export": True} and req.sampling["max_tokens"] == 1
    done = {"ev": "done", "tokens": [5], "finish_reason": "length", "usage": {"prompt_tokens": 2}}
    params = kv_transfer.response_params(done, "w1", "board-0")
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "board-0"
    # the router copies these into the decode leg: the original body plus them
    decode_body = {"model": "tiny", "prompt": "hello world", "max_tokens": 5, "stream": True,
                   "kv_transfer_params": params}
    dreq = parse_completion(decode_body)
    assert dreq.handoff == {"board": "board-0", "request": "w1", "prompt_len": 2, "blocks": []}
    assert wire(dreq)["handoff"]["board"] == "board-0"


def test_an_exported_descriptor_travels_whole():
    desc = {"board": "b", "request": "r", "prompt_len": 32, "blocks": [1, 2], "layout": {"block_size": 16},
            "host_pool": {"name": "/npuserve-1-2-kvh", "slots": 8, "slot_bytes": 4160, "layout": "0" * 16, "host": "h"}}
    params = kv_transfer.response_params({"handoff": desc}, "w1", "x")
    assert params["remote_block_ids"] == [1, 2]
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": params}).handoff == desc


def test_other_peers_params_are_a_recompute_and_min_tokens_is_kept_elsewhere():
    nixl = {"do_remote_prefill": True, "remote_engine_id": "e" * 300, "remote_block_ids": [3],
            "remote_host": "10.0.0.1", "remote_port": 5600}
    h = parse_completion({"prompt": "x", "kv_transfer_params": nixl}).handoff
    assert h["prompt_len"] == 0 and len(h["board"]) == 128
    assert parse_completion({"prompt": "x", "kv_transfer_params": None}).handoff is None
    assert parse_completion({"prompt": "x", "kv_transfer_params": {}}).handoff is None
    with pytest.raises(OpenAIError):
        parse_completion({"prompt": "x", "kv_transfer_params": []})
    assert parse_completion({"prompt": "x", "min_tokens": 1}).sampling["min_tokens"] == 1


def test_a_mangled_descriptor_is_a_recompute_not_a_refused_request():
    params = {"do_remote_prefill": True, kv_transfer.OURS: {"board": "b" * 300, "request": "", "prompt_len": -3,
                                                             "blocks": [1, "x"], "layout": {"k": [1]},
                                                             "first_token": True,
                                                             "host_pool": {"name": 3, "slots": 1}}}
    h = parse_completion({"prompt": "x", "kv_transfer_params": params}).handoff
    assert h == {"board": "b" * 128, "request": "remote", "prompt_len": 0, "blocks": []}
    assert wire(parse_completion({"prompt": "x", "kv_transfer_params": params}))["handoff"] == h
