"""The wire shape of `generate`'s `constraint` (whether it compiles is the daemon's check)."""

from __future__ import annotations

import pytest

from ipc.schema import MAX_CONSTRAINT_CHARS, ProtocolError, validate_request


def gen(constraint) -> dict:
    return validate_request({"v": 1, "op": "generate", "id": "r", "prompt": [1], "constraint": constraint})


def test_absent_null_and_the_kinds_pass_through():
    assert "constraint" not in validate_request({"v": 1, "op": "generate", "id": "r", "prompt": [1]})
    assert gen(None)["constraint"] is None
    assert gen({"kind": "json_object"})["constraint"] == {"kind": "json_object", "body": ""}
    assert gen({"kind": "json_schema", "body": {"type": "object"}})["constraint"]["body"] == {"type": "object"}
    for kind in ("json_schema", "regex", "lark", "gbnf"):
        assert gen({"kind": kind, "body": "x"})["constraint"] == {"kind": kind, "body": "x"}


@pytest.mark.parametrize("constraint, reason, words", [
    ("json", "bad_type", "kind and body"),
    ({"kind": "xml", "body": "x"}, "out_of_range", "kind: must be one of"),
    ({"kind": "regex"}, "bad_type", "must be a string"),
    ({"kind": "regex", "body": ""}, "out_of_range", "must not be empty"),
    ({"kind": "regex", "body": "x", "strict": True}, "unknown_field", "constraint.strict"),
    ({"kind": "regex", "body": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "out_of_range", "at most"),
    ({"kind": "json_schema", "body": {"d": "a" * MAX_CONSTRAINT_CHARS}}, "out_of_range", "characters of JSON"),
])
def test_malformed_constraints_are_400s_naming_the_field(constraint, reason, words):
    with pytest.raises(ProtocolError) as info:
        gen(constraint)
    assert info.value.reason == reason and words in info.value.message
