"""A chat request's prompt with its tools: the template's own `tools` when it takes them, else the generic format.

* A Jinja chat template that mentions `tools` (Hugging Face's convention)
  renders them itself: it gets `tools` (OpenAI's tool objects) and the
  history's `tool_calls` (with `arguments` as objects, as those templates
  expect) and `tool` messages as they are.
* Any other template (llama.cpp's built-in formats, a template without tool
  support) gets the generic format, as llama.cpp's server does for such
  templates: the tools and the answer shape are described in the system
  turn; an assistant turn's calls are written as the JSON answer the model
  gives; a `tool` message becomes a user turn holding
  `{"tool_response": {"tool_call_id", "name", "content"}}` (consecutive ones
  merged, so templates that insist on alternating roles accept them).
"""

from __future__ import annotations

import json
import re

from engine.http.chat_template import ChatTemplate
from engine.http.tool_calls import ToolSpec

_TAKES_TOOLS = re.compile(r"\btools\b")
CALL_SHAPE = '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}'


def takes_tools(template) -> bool:
    """The template renders `tools` itself (a Jinja template that uses the variable)."""
    return isinstance(template, ChatTemplate) and bool(_TAKES_TOOLS.search(template.source))


def system_text(spec: ToolSpec) -> str:
    """The generic format's description of the tools and of a tool-call answer."""
    tools = "\n".join(json.dumps(t.prompt_entry(), ensure_ascii=False) for t in spec.callable_tools())
    how = {"auto": "To call tools, answer with only this JSON object and nothing else: " + CALL_SHAPE
                   + ". To answer the user directly, write plain text instead.",
           "required": "Answer with only this JSON object, calling one or more tools: " + CALL_SHAPE + ".",
           "function": f"Answer with only this JSON object, calling the tool {spec.function}: " + CALL_SHAPE + "."}
    many = " Call one tool at a time." if spec.single else " Several calls may go in the list."
    return "You can call these tools (each one's arguments are described by the JSON schema `parameters`):\n" \
        + tools + "\n\n" + how[spec.choice] + many


def _arguments_object(args: str):
    try:
        v = json.loads(args)
    except ValueError:
        return args
    return v if type(v) is dict else args


def _names_by_id(messages: list[dict]) -> dict[str, str]:
    return {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())}


def generic_messages(messages: list[dict], spec: ToolSpec | None) -> list[dict]:
    """The history in the generic format (plain roles and text only), the tools' description in the system
    turn when the model is offered them."""
    names = _names_by_id(messages)
    out: list[dict] = []
    from_tool: list[bool] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}
                     for c in m["tool_calls"]]
            call_text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            content = f"{content.strip()}\n{call_text}" if content.strip() else call_text
            m = {"role": role, "content": content}
        elif role == "tool":
            resp: dict = {}
            if m.get("tool_call_id"):
                resp["tool_call_id"] = m["tool_call_id"]
            name = m.get("name") or names.get(m.get("tool_call_id", ""))
            if name:
                resp["name"] = name
            resp["content"] = content
            m = {"role": "user", "content": json.dumps({"tool_response": resp}, ensure_ascii=False)}
            if out and out[-1]["role"] == "user":  # a tool result after a tool result or a user turn
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + m["content"]}
                from_tool[-1] = True
                continue
        elif role == "user" and out and out[-1]["role"] == "user" and from_tool[-1]:
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + content}
            continue
        else:
            m = {k: v for k, v in m.items() if k in ("role", "content", "name")}
        out.append(m)
        from_tool.append(role == "tool")
    if spec is not None and spec.active:
        text = system_text(spec)
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0]["content"].rstrip()
            out[0] = dict(out[0], content=f"{first}\n\n{text}" if first else text)
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def native_messages(messages: list[dict]) -> list[dict]:
    """The history as Hugging Face templates take it: calls' `arguments` as objects, tool messages named."""
    names = _names_by_id(messages)
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[{"id": c["id"], "type": "function",
                                     "function": {"name": c["function"]["name"],
                                                  "arguments": _arguments_object(c["function"]["arguments"])}}
                                    for c in m["tool_calls"]])
        elif m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m = dict(m, name=names[m["tool_call_id"]])
        out.append(m)
    return out


def has_tool_turns(messages: list[dict]) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def render(template, messages: list[dict], spec: ToolSpec | None, add_generation_prompt: bool,
           template_kwargs: dict) -> str:
    """The prompt text of a chat request (tools and tool turns included)."""
    if (spec is None or not spec.tools) and not has_tool_turns(messages):
        return template.render(messages, add_generation_prompt, template_kwargs)
    if takes_tools(template):
        extra = dict(template_kwargs)
        if spec is not None and spec.active:
            extra["tools"] = [t.openai() for t in spec.callable_tools()]
        return template.render(native_messages(messages), add_generation_prompt, extra)
    return template.render(generic_messages(messages, spec), add_generation_prompt, template_kwargs)
