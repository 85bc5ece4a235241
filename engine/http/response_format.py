"""The constraint fields peers' clients send -> the wire's `constraint` (kind + body), or None.

Pure field mapping; compiling and the 400 for a schema or grammar that does
not compile are the daemon's (`engine.daemon.constraint_cache`), so every
client of the board gets the same answer.

* OpenAI: `response_format` `{"type": "text"}` (none), `{"type": "json_object"}`
  (any JSON object), `{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}`. The schema is enforced whatever `strict` says: the sampler can
  only produce what the constraint accepts. llama.cpp's server also reads a
  `schema` beside `{"type": "json_object"}`; so do we.
* vLLM: `guided_json` (schema object or string), `guided_regex`,
  `guided_grammar` (Lark or GBNF: llguidance tells them apart),
  `guided_choice` (one of a list of strings: a Lark alternation).
* llama.cpp's server: `json_schema` (object), `grammar` (GBNF).

One request takes one constraint: two of these fields at once is a 400.
"""

from __future__ import annotations

import json
from typing import Any

from engine.http.openai_error import bad

FIELDS = frozenset({"response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice", "json_schema",
                    "grammar"})
MAX_CHOICES = 1024


def _response_format(v: Any) -> dict | None:
    if type(v) is not dict:
        raise bad("response_format", "must be an object with a type", "invalid_type")
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = v.get("schema")
        if schema is None:
            return {"kind": "json_object", "body": ""}
        if type(schema) not in (dict, bool):
            raise bad("response_format.schema", "must be a JSON schema object", "invalid_type")
        return {"kind": "json_schema", "body": schema}
    if kind == "json_schema":
        js = v.get("json_schema")
        if type(js) is not dict:
            raise bad("response_format.json_schema", "must be an object with name and schema", "invalid_type")
        if js.get("strict") is not None and type(js["strict"]) is not bool:
            raise bad("response_format.json_schema.strict", "must be true or false", "invalid_type")
        schema = js.get("schema", {"type": "object"})  # OpenAI: a missing schema means any object
        if type(schema) not in (dict, bool):
            raise bad("response_format.json_schema.schema", "must be a JSON schema object", "invalid_type")
        return {"kind": "json_schema", "body": schema}
    raise bad("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _text(name: str, v: Any) -> str:
    if type(v) is not str or not v:
        raise bad(name, "must be a non-empty string", "invalid_type")
    return v


def _choice(v: Any) -> dict:
    if type(v) is not list or not v or not all(type(c) is str and c for c in v):
        raise bad("guided_choice", "must be a non-empty list of non-empty strings", "invalid_type")
    if len(v) > MAX_CHOICES:
        raise bad("guided_choice", f"at most {MAX_CHOICES} choices, got {len(v)}")
    return {"kind": "lark", "body": "start: " + " | ".join(json.dumps(c) for c in v)}  # JSON strings are Lark's


def constraint_of(body: dict) -> dict | None:
    """The wire constraint a request body asks for (None: unconstrained)."""
    found: list[tuple[str, dict | None]] = []
    if body.get("response_format") is not None:
        found.append(("response_format", _response_format(body["response_format"])))
    if body.get("guided_json") is not None:
        g = body["guided_json"]
        if type(g) not in (dict, str) or g == "":
            raise bad("guided_json", "must be a JSON schema (object or non-empty string)", "invalid_type")
        found.append(("guided_json", {"kind": "json_schema", "body": g}))
    if body.get("json_schema") is not None:
        g = body["json_schema"]
        if type(g) is not dict:
            raise bad("json_schema", "must be a JSON schema object", "invalid_type")
        found.append(("json_schema", {"kind": "json_schema", "body": g}))
    if body.get("guided_regex") is not None:
        found.append(("guided_regex", {"kind": "regex", "body": _text("guided_regex", body["guided_regex"])}))
    if body.get("guided_grammar") is not None:
        found.append(("guided_grammar", {"kind": "gbnf", "body": _text("guided_grammar", body["guided_grammar"])}))
    if body.get("guided_choice") is not None:
        found.append(("guided_choice", _choice(body["guided_choice"])))
    if body.get("grammar") is not None:
        found.append(("grammar", {"kind": "gbnf", "body": _text("grammar", body["grammar"])}))
    asked = [(name, c) for name, c in found if c is not None]
    if len(asked) > 1:
        raise bad(asked[1][0], f"one constraint per request: {asked[0][0]} is already given", "conflicting_fields")
    return asked[0][1] if asked else None
