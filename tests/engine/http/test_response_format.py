"""The peers' constraint fields -> the wire's `constraint` (pure mapping; compiling is the daemon's)."""

from __future__ import annotations

import pytest

from engine.daemon.constraint_cache import grammar_of
from engine.http.openai_error import OpenAIError
from engine.http.openai_request import parse_chat, parse_completion
from engine.http.response_format import constraint_of

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("body, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"kind": "json_object", "body": ""}),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, {"kind": "json_schema", "body": SCHEMA}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     {"kind": "json_schema", "body": SCHEMA}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     {"kind": "json_schema", "body": {"type": "object"}}),
    ({"guided_json": SCHEMA}, {"kind": "json_schema", "body": SCHEMA}),
    ({"guided_json": '{"type": "object"}'}, {"kind": "json_schema", "body": '{"type": "object"}'}),
    ({"json_schema": SCHEMA}, {"kind": "json_schema", "body": SCHEMA}),
    ({"guided_regex": "[0-9]+"}, {"kind": "regex", "body": "[0-9]+"}),
    ({"guided_grammar": 'root ::= "a"'}, {"kind": "gbnf", "body": 'root ::= "a"'}),
    ({"grammar": 'root ::= "a"'}, {"kind": "gbnf", "body": 'root ::= "a"'}),
    ({"guided_choice": ["yes", 'no "way"']}, {"kind": "lark", "body": 'start: "yes" | "no \\"way\\""'}),
])
def test_fields_map_onto_one_wire_constraint(body, want):
    assert constraint_of(body) == want


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format.json_schema.schema"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": SCHEMA, "grammar": 'root ::= "a"'}, "grammar"),
])
def test_malformed_or_conflicting_fields_are_400s_naming_the_field(body, param):
    with pytest.raises(OpenAIError) as info:
        constraint_of(body)
    assert info.value.status == 400 and info.value.body()["error"]["param"] == param


def test_requests_carry_the_constraint_in_their_wire_fields_and_choices_compile():
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}})
    assert chat.sampling["constraint"] == {"kind": "json_object", "body": ""}
    comp = parse_completion({"prompt": "x", "guided_choice": ["a", "b"]})
    assert grammar_of(**comp.sampling["constraint"])
    assert "constraint" not in parse_completion({"prompt": "x", "response_format": {"type": "text"}}).sampling
