"""Alternatives and prompt logprobs through the balancer core (fake clock): passed through, asked once."""

from __future__ import annotations

from engine.balancer.actions import EmitTokens
from ipc.schema import validate_request

from test_balancer_core import A, B, C, make, sends


def gen(**kw) -> dict:
    return validate_request({"v": 1, "op": "generate", "id": "x", "prompt": [1, 2, 3], **kw})


def test_alternatives_and_prompt_logprobs_pass_through_and_a_resumed_leg_does_not_ask_for_the_prompt_again():
    core = make(names=(A, B, C))
    (s,) = sends(core.submit(1, gen(top_logprobs=2, prompt_logprobs=1, max_tokens=4, logprobs=True), 0.1))
    assert s.msg["top_logprobs"] == 2 and s.msg["prompt_logprobs"] == 1
    prompt_lp = {"tokens": [1, 2, 3], "logprobs": [None, -1.0, -2.0], "top_logprobs": [[], [[5, -0.5]], [[6, -0.25]]]}
    out = core.on_event(s.backend, {"v": 1, "ev": "tokens", "id": s.msg["id"], "tokens": [], "logprobs": [],
                                    "prompt_logprobs": prompt_lp}, 0.2)
    out += core.on_event(s.backend, {"v": 1, "ev": "tokens", "id": s.msg["id"], "tokens": [7], "logprobs": [-0.1],
                                     "top_logprobs": [[[7, -0.1], [8, -2.5]]]}, 0.3)
    emits = [a for a in out if isinstance(a, EmitTokens)]
    assert emits[0].prompt_logprobs == prompt_lp and emits[0].tokens == []
    assert emits[1].top_logprobs == [[[7, -0.1], [8, -2.5]]] and emits[1].logprobs == [-0.1]
    (m,) = sends(core.on_disconnect(s.backend, 0.4))  # the stream broke: resumed elsewhere
    assert m.msg["continuation"] == [7] and m.msg["top_logprobs"] == 2 and "prompt_logprobs" not in m.msg


def test_requests_that_ask_nothing_send_no_new_fields_upstream():
    core = make()
    (s,) = sends(core.submit(1, gen(max_tokens=2), 0.1))
    assert "top_logprobs" not in s.msg and "prompt_logprobs" not in s.msg


def test_disaggregated_legs_ask_the_prompt_logprobs_of_the_prefill_leg_only():
    from engine.balancer.pd_routing import decode_msg, prefill_msg

    m = gen(prompt_logprobs=0, max_tokens=0)
    assert prefill_msg(m, [])["max_tokens"] == 0 and prefill_msg(m, [])["prompt_logprobs"] == 0
    assert prefill_msg(gen(max_tokens=5), [])["max_tokens"] == 1
    assert "prompt_logprobs" not in decode_msg(gen(prompt_logprobs=2), {"x": 1})
