"""OpenAI bodies -> generate parameters (engine.http.openai_request): pure, no processes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.http.openai_error import OpenAIError
from engine.http.openai_request import (
    COMPLETION_FIELDS, MAX_PROMPTS, parse_chat, parse_completion, parse_prompts, tenant_of_user,
)


def err(fn, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        fn(body)
    assert e.value.status == 400
    return e.value


def test_a_plain_completion_gets_openais_defaults():
    r = parse_completion({"model": "m", "prompt": "hi"})
    assert (r.kind, r.model, r.prompts, r.stream, r.include_usage, r.logprobs) == ("completion", "m", ["hi"],
                                                                                   False, False, False)
    assert r.sampling["max_tokens"] == 16 and r.sampling["temperature"] == 1.0
    assert 0 <= r.sampling["seed"] < 2**63  # sampling without a seed: a fresh one


def test_greedy_without_a_seed_sends_none_and_a_seed_is_kept():
    assert "seed" not in parse_completion({"prompt": "x", "temperature": 0}).sampling
    assert parse_completion({"prompt": "x", "seed": 5}).sampling["seed"] == 5
    assert parse_completion({"prompt": "x", "seed": -1}).sampling["seed"] == 2**64 - 1


def test_parameters_map_to_wire_fields():
    r = parse_completion({"prompt": [1, 2], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": -1,
                          "seed": 3, "stop": "\n", "stop_token_ids": [9], "ignore_eos": True, "priority": 2,
                          "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0,
                          "user": "u"})
    assert r.prompts == [[1, 2]] and r.stream and r.include_usage and r.logprobs and r.user == "u"
    assert r.sampling == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 0, "seed": 3, "stop": ["\n"],
                          "stop_token_ids": [9], "ignore_eos": True, "priority": 2}


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse_completion({"prompt": "x", "max_tokens": 3, "max_completion_tokens": 9}).sampling["max_tokens"] == 9
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}).sampling["max_tokens"] is None


@pytest.mark.parametrize("prompt,expected", [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_forms(prompt, expected):
    assert parse_prompts(prompt) == expected


@pytest.mark.parametrize("prompt", [[], [[]], ["a", 1], [1, [2]], [-1], [2**31], 3, None, {"a": 1}, [True]])
def test_bad_prompts(prompt):
    assert err(parse_completion, {"prompt": prompt}).param.startswith("prompt")


def test_too_many_prompts():
    assert "at most" in err(parse_completion, {"prompt": ["x"] * (MAX_PROMPTS + 1)}).message


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 17), ("best_of", 0), ("best_of", 17), ("echo", 1), ("suffix", "x"), ("presence_penalty", 2.5),
    ("frequency_penalty", -3), ("logit_bias", {"1": 101}), ("logit_bias", {"x": 1}), ("logit_bias", [1]),
    ("repetition_penalty", 0), ("min_p", 2), ("min_p", "0.1"), ("min_tokens", -1), ("min_tokens", 1.5),
    ("no_stop_trim", True), ("skip_special_tokens", False), ("return_hidden_states", True),
    ("logprobs", 21), ("logprobs", -1), ("max_tokens", 0), ("max_tokens", 1.5), ("temperature", -1),
    ("temperature", True), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("seed", 2**64), ("stop", [""]),
    ("stop", ["x"] * 17), ("stop", 5), ("stream", "yes"), ("stream_options", {"include_usage": True}),
    ("user", 5), ("model", ""), ("stop_token_ids", [-1]), ("priority", 101), ("unknown_thing", 1),
])
def test_each_bad_completion_field_is_a_400_naming_it(field, value):
    e = err(parse_completion, {"prompt": "x", field: value})
    assert e.param == field and field in e.message
    assert e.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [
    ("echo", False), ("no_stop_trim", False), ("ignore_eos", False), ("skip_special_tokens", True),
    ("return_hidden_states", False), ("n", 1), ("best_of", None), ("logit_bias", {}), ("presence_penalty", 0.0),
    ("min_tokens", 0),
])
def test_neutral_values_of_unbuilt_features_are_accepted(field, value):
    parse_completion({"prompt": "x", field: value})


def test_what_vllm_router_adds_to_a_chat_body_is_accepted():
    body = {"messages": [{"role": "user", "content": "x"}], "stream": False, "logprobs": False, "no_stop_trim": False,
            "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
            "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
            "include_reasoning": True, "temperature": 0.0}
    r = parse_chat(body)
    assert r.messages == [{"role": "user", "content": "x"}] and r.sampling["temperature"] == 0.0


@pytest.mark.parametrize("messages,param", [
    ([], "messages"), ("hi", "messages"), ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}], "messages[0].tool_calls"),
])
def test_bad_messages(messages, param):
    assert err(parse_chat, {"messages": messages}).param == param


def test_chat_content_parts_join_and_chat_only_fields():
    r = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]},
                                 {"role": "assistant", "content": None}],
                    "logprobs": True, "top_logprobs": 0, "add_generation_prompt": False,
                    "chat_template_kwargs": {"x": 1}})
    assert r.messages == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]
    assert r.logprobs and not r.add_generation_prompt and r.template_kwargs == {"x": 1}
    assert err(parse_chat, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).param == \
        "top_logprobs"
    assert err(parse_chat, {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}).param \
        == "continue_final_message"
    assert err(parse_chat, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}).param \
        == "tools"
    assert err(parse_chat, {"prompt": "x"}).param == "prompt"  # a completions field is unknown here


@pytest.mark.parametrize("user,tenant", [(None, "default"), ("", "default"), ("alice", "alice"),
                                         ("a@b.c", "a_b.c"), ("-x", "_-x"), ("x" * 80, "x" * 64)])
def test_tenant_of_user(user, tenant):
    assert tenant_of_user(user) == tenant


@given(st.dictionaries(st.sampled_from(sorted(COMPLETION_FIELDS)),
                       st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True),
                                 st.text(max_size=3), st.lists(st.integers(-1, 3), max_size=3))))
def test_any_body_is_parsed_or_one_openai_error(body):
    try:
        parse_completion(body)
    except OpenAIError as e:
        assert e.status == 400 and set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_logprob_and_choice_fields_become_their_wire_asks():
    r = parse_completion({"prompt": "x", "logprobs": 3, "echo": True, "max_tokens": 0, "n": 2, "best_of": 4})
    assert (r.top_logprobs, r.echo, r.n, r.best_of) == (3, True, 2, 4)
    assert r.sampling["top_logprobs"] == 3 and r.sampling["prompt_logprobs"] == 3 and r.sampling["max_tokens"] == 0
    r = parse_completion({"prompt": "x", "echo": True, "max_tokens": 0})  # scoring without logprobs: no tops
    assert r.sampling["prompt_logprobs"] == 0 and "top_logprobs" not in r.sampling
    assert "prompt_logprobs" not in parse_completion({"prompt": "x", "echo": True}).sampling  # echo: the text
    c = parse_chat({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20})
    assert c.sampling["top_logprobs"] == 20
    for body, field in (({"logprobs": False, "top_logprobs": 2}, "top_logprobs"), ({"max_tokens": 0}, "max_tokens"),
                        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        e = err(parse_chat, {"messages": [{"role": "user", "content": "hi"}], **body})
        assert e.param == field
    e = err(parse_completion, {"prompt": "x", "best_of": 2, "stream": True})
    assert e.param == "best_of"
