"""Tool calling on /v1/chat/completions: the request's tools, the constraint they imply, the parsed answer.

The model answers a tool call in one JSON shape, whatever its chat template
(documented in docs/http.md, "Tool calling"):

    {"tool_calls": [{"name": "<function>", "arguments": {...}}, ...]}

* `tool_choice: "required"` or a named function: the output is constrained
  (llguidance JSON schema) to that object, each call's `arguments` to its
  function's `parameters`; so it always parses and validates unless cut short
  (`max_tokens`, a stop string).
* `"auto"`: a Lark grammar allowing either plain text that does not start
  with `{`, or that object; text stays text, a `{` answer is a call.
* `"none"`: no tools offered, no constraint, the answer is text.

`parallel_tool_calls: false` (and a named function) allow exactly one call.
The answer is parsed after the fact (`parse_answer`), which also takes
Hermes' `<tool_call>{"name", "arguments"}</tool_call>` blocks (what models
whose own chat template renders the tools answer with `auto`); an answer
that does not parse is returned as text, never an error. Pure: no I/O.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from engine.http.openai_error import bad

FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
MAX_TOOLS = 128
# The wire encoder (orjson) nests at most 255 levels; the answer schema wraps `parameters` in a few more.
MAX_SCHEMA_DEPTH = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Compact JSON without free whitespace, as the daemon compiles response_format schemas: a small model offered
# free whitespace can spend its whole budget on newlines.
_X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_checked: OrderedDict[str, str] = OrderedDict()  # schema JSON -> "" (compiles) or llguidance's error


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def prompt_entry(self) -> dict:
        """How the generic format lists the tool in the system turn."""
        out: dict = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["parameters"] = self.parameters
        return out

    def openai(self) -> dict:
        """The OpenAI tool object (what a chat template that takes `tools` is given)."""
        fn: dict = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and how they may be used."""

    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None = None  # the function tool_choice names (choice == "function")
    parallel: bool = True

    @property
    def active(self) -> bool:
        """The model is offered the tools and its answer may be a call."""
        return bool(self.tools) and self.choice != "none"

    @property
    def single(self) -> bool:
        return self.choice == "function" or not self.parallel

    def callable_tools(self) -> tuple[Tool, ...]:
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools

    def answer_schema(self) -> dict:
        """The JSON schema of a tool-call answer: `{"tool_calls": [call, ...]}`, each call's `arguments` its
        function's `parameters`."""
        calls = [{"type": "object",
                  "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for t in self.callable_tools()]
        items = calls[0] if len(calls) == 1 else {"anyOf": calls}
        array: dict = {"type": "array", "items": items, "minItems": 1}
        if self.single:
            array["maxItems"] = 1
        return {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
                "additionalProperties": False}

    def constraint(self) -> dict | None:
        """The wire `constraint` the choice asks for (None: the answer is free)."""
        if not self.active:
            return None
        if self.choice in ("required", "function"):
            return {"kind": "json_schema", "body": self.answer_schema()}
        schema = dict(self.answer_schema(), **{"x-guidance": _X_GUIDANCE})
        # plain text that does not start with "{" (after optional whitespace), or the call object
        return {"kind": "lark", "body": "start: TEXT | call\nTEXT: /\\s*[^\\s{][\\s\\S]*/\n"
                                        f"call: %json {json.dumps(schema, ensure_ascii=False)}"}


# -- the request ----------------------------------------------------------------------------------------------
def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion (a hostile body may nest as deep as the parser lets)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if type(v) is dict:
            v = list(v.values())
        if type(v) is list:
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in v)
    return deepest


def _check_schema(where: str, schema: dict) -> None:
    """400 naming the field when llguidance cannot compile the schema (checked here, so the error names
    which tool; the daemon compiles the whole answer grammar again, cached)."""
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise bad(where, f"the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep", "invalid_tool_schema")
    key = json.dumps(schema, sort_keys=True)
    error = _checked.get(key)
    if error is None:
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_X_GUIDANCE)
            error = (llguidance.LLMatcher.validate_grammar(grammar) or "").strip()
        except (ValueError, TypeError) as e:
            error = str(e) or type(e).__name__
        _checked[key] = error
        while len(_checked) > 256:
            _checked.popitem(last=False)
    else:
        _checked.move_to_end(key)
    if error:
        raise bad(where, f"the schema does not compile: {error}", "invalid_tool_schema")


def _tool(i: int, t: Any) -> Tool:
    where = f"tools[{i}]"
    if type(t) is not dict or t.get("type", "function") != "function":
        raise bad(f"{where}.type", "only function tools ({\"type\": \"function\", \"function\": {...}}) are "
                                   "supported", "unsupported_value")
    fn = t.get("function")
    if type(fn) is not dict:
        raise bad(f"{where}.function", "must be an object with name, description and parameters", "invalid_type")
    name = fn.get("name")
    if type(name) is not str or not _NAME.match(name):
        raise bad(f"{where}.function.name", f"must be 1-64 characters of a-z, A-Z, 0-9, _, ., -; got {name!r}")
    desc = fn.get("description")
    if desc is not None and type(desc) is not str:
        raise bad(f"{where}.function.description", "must be a string", "invalid_type")
    if fn.get("strict") is not None and type(fn["strict"]) is not bool:
        raise bad(f"{where}.function.strict", "must be true or false", "invalid_type")
    params = fn.get("parameters")
    if params is None:
        params = _EMPTY_PARAMETERS
    elif type(params) is not dict:
        raise bad(f"{where}.function.parameters", "must be a JSON schema object", "invalid_type")
    else:
        _check_schema(f"{where}.function.parameters", params)
    return Tool(name, desc or "", params)


def parse_tools(body: dict) -> ToolSpec | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` of a chat body (None: the body names no tools)."""
    raw = body.get("tools")
    tools: list[Tool] = []
    if raw is not None:
        if type(raw) is not list:
            raise bad("tools", "must be a list of tools", "invalid_type")
        if len(raw) > MAX_TOOLS:
            raise bad("tools", f"at most {MAX_TOOLS} tools, got {len(raw)}")
        for i, t in enumerate(raw):
            tool = _tool(i, t)
            if any(x.name == tool.name for x in tools):
                raise bad(f"tools[{i}].function.name", f"{tool.name!r} is given twice")
            tools.append(tool)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and type(parallel) is not bool:
        raise bad("parallel_tool_calls", f"must be true or false, got {parallel!r}", "invalid_type")
    tc = body.get("tool_choice")
    function = None
    if tc is None:
        choice = "auto" if tools else "none"
    elif tc in ("none", "auto", "required"):
        choice = tc
    elif type(tc) is dict:
        fn = tc.get("function")
        name = fn.get("name") if type(fn) is dict else None
        if tc.get("type") != "function" or type(name) is not str:
            raise bad("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"function\": "
                                     "{\"name\": ...}}", "invalid_type")
        choice, function = "function", name
    else:
        raise bad("tool_choice", f"must be none, auto, required or a named function, got {tc!r}")
    if choice in ("required", "function") and not tools:
        raise bad("tool_choice", f"{'required' if choice == 'required' else 'a named function'} needs tools")
    if function is not None and all(t.name != function for t in tools):
        raise bad("tool_choice.function.name", f"{function!r} is not one of the tools")
    if raw is None and tc is None and parallel is None:
        return None
    return ToolSpec(tuple(tools), choice, function, True if parallel is None else parallel)


def history_fields(where: str, role: str, m: dict) -> dict:
    """The tool fields of a history message: an assistant's `tool_calls` (validated; `arguments` kept as the
    JSON text the client sent), a tool message's `tool_call_id` (and `name`)."""
    out: dict = {}
    calls = m.get("tool_calls")
    if calls is not None and calls != []:
        if role != "assistant":
            raise bad(f"{where}.tool_calls", "only assistant messages carry tool_calls")
        if type(calls) is not list:
            raise bad(f"{where}.tool_calls", "must be a list of tool calls", "invalid_type")
        norm = []
        for j, c in enumerate(calls):
            w = f"{where}.tool_calls[{j}]"
            fn = c.get("function") if type(c) is dict else None
            if type(fn) is not dict or type(fn.get("name")) is not str:
                raise bad(w, "must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}",
                          "invalid_type")
            args = fn.get("arguments", "{}")
            if type(args) is dict:
                args = json.dumps(args, ensure_ascii=False)
            if type(args) is not str:
                raise bad(f"{w}.function.arguments", "must be a JSON string", "invalid_type")
            cid = c.get("id")
            if cid is not None and type(cid) is not str:
                raise bad(f"{w}.id", "must be a string", "invalid_type")
            norm.append({"id": cid or f"call_{j}", "type": "function",
                         "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = norm
    if role == "tool":
        cid = m.get("tool_call_id")
        if cid is not None and type(cid) is not str:
            raise bad(f"{where}.tool_call_id", "must be a string", "invalid_type")
        if cid:
            out["tool_call_id"] = cid
    return out


# -- the answer -----------------------------------------------------------------------------------------------
def new_call_id() -> str:
    return "call_" + os.urandom(12).hex()


def _calls_of(value: Any) -> list | None:
    """The call objects of a parsed answer: `{"tool_calls": [...]}`, also `{"tool_call": {...}}` (llama.cpp's
    single-call spelling) and one bare `{"name", "arguments"}`."""
    if type(value) is not dict:
        return None
    if "tool_calls" in value:
        calls = value["tool_calls"]
        return calls if type(calls) is list and calls and len(value) == 1 else None
    if "tool_call" in value:
        return [value["tool_call"]] if len(value) == 1 else None
    if "name" in value:
        return [value]
    return None


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"\s*<tool_call>(.*?)</tool_call>\s*", re.S)


def _hermes_calls(s: str) -> list:
    """The calls of an answer in Hermes' format (Qwen 2.5/3 and others whose chat templates take tools):
    `<tool_call>{"name", "arguments"}</tool_call>` blocks and nothing else."""
    calls, i = [], 0
    while i < len(s):
        m = _HERMES_BLOCK.match(s, i)
        if m is None:
            raise ValueError("not only <tool_call> blocks")
        calls.append(json.loads(m.group(1)))
        i = m.end()
    return calls


def parse_answer(text: str, spec: ToolSpec) -> list[dict] | None:
    """The answer's tool calls as OpenAI's `message.tool_calls` (fresh ids), or None: it is text (not the
    call object, invalid JSON, an unknown function, arguments that are not an object, too many calls)."""
    s = text.strip()
    try:
        if s.startswith(HERMES_OPEN):
            calls = _hermes_calls(s)
        elif s.startswith("{"):
            calls = _calls_of(json.loads(s))
        else:
            return None
    except ValueError:
        return None
    if not calls or (spec.single and len(calls) > 1):
        return None
    names = {t.name for t in spec.callable_tools()}
    out = []
    for c in calls:
        if type(c) is not dict or c.get("name") not in names:
            return None
        args = c.get("arguments", c.get("parameters", {}))
        if type(args) is str:
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if type(args) is not dict:
            return None
        out.append({"id": new_call_id(), "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    return out
