"""Streaming a tool-call answer as OpenAI's `delta.tool_calls` chunks (pure: text in, deltas out).

The answer text grows batch by batch. `scan` reads the partial text of
`{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` (tolerating the
other spellings `tool_calls.parse_answer` takes) and says, per call, its
name once the name's string is complete and the raw text of its `arguments`
so far. `ToolCallStream` turns the growth into deltas: the call's `index`,
`id`, `type` and `name` first, then each new piece of the arguments text,
so the pieces concatenated are the arguments' JSON as the model wrote it.

With `tool_choice: auto` the answer is text unless its first non-blank
character is `{` (or it opens with Hermes' `<tool_call>`, whose calls are
sent whole at the end): until that is decided nothing is sent; text then
streams as usual. A call answer that does not parse in the end (cut short by
`max_tokens` or a stop string) is sent as text if no call delta has gone out
yet; otherwise the stream ends with the upstream's finish reason.
"""

from __future__ import annotations

import json

from engine.http.openai_response import ChunkWriter, TokenText
from engine.http.stream_encoder import StreamEncoder
from engine.http.tool_calls import HERMES_OPEN, ToolSpec, new_call_id, parse_answer

_BLANK = " \t\r\n"
_SCALAR = frozenset("-+0123456789.eE" "truefalsn")


class _End(Exception):
    """The text ends inside the value being read."""


class _Bad(Exception):
    """The text is not the call object."""


def _ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _BLANK:
        i += 1
    return i


def _string(s: str, i: int) -> int:
    """s[i] is '"': the index after the closing quote."""
    i += 1
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i + 1
        else:
            i += 1
    raise _End


def _value(s: str, i: int) -> int:
    """The index after the JSON value starting at s[i] (no blanks before it)."""
    if i >= len(s):
        raise _End
    c = s[i]
    if c == '"':
        return _string(s, i)
    if c in "{[":
        stack = [c]
        i += 1
        while i < len(s):
            c = s[i]
            if c == '"':
                i = _string(s, i)
                continue
            if c in "{[":
                stack.append(c)
            elif c in "}]":
                if stack.pop() != ("{" if c == "}" else "["):
                    raise _Bad
                if not stack:
                    return i + 1
            i += 1
        raise _End
    j = i
    while j < len(s) and s[j] in _SCALAR:
        j += 1
    if j == i:
        raise _Bad
    if j == len(s):
        raise _End  # a number may go on
    return j


def _members(s: str, i: int, member) -> int:
    """Read the object at s[i] ('{'), calling member(key, index of its value) -> index after the value."""
    if i >= len(s):
        raise _End
    if s[i] != "{":
        raise _Bad
    i = _ws(s, i + 1)
    if i < len(s) and s[i] == "}":
        return i + 1
    while True:
        i = _ws(s, i)
        if i >= len(s):
            raise _End
        if s[i] != '"':
            raise _Bad
        end = _string(s, i)
        key = json.loads(s[i:end])
        i = _ws(s, end)
        if i >= len(s):
            raise _End
        if s[i] != ":":
            raise _Bad
        i = member(key, _ws(s, i + 1))
        i = _ws(s, i)
        if i >= len(s):
            raise _End
        if s[i] == "}":
            return i + 1
        if s[i] != ",":
            raise _Bad
        i += 1


class _Call:
    __slots__ = ("name", "args", "args_done")

    def __init__(self) -> None:
        self.name: str | None = None
        self.args = ""  # the raw text of `arguments` read so far
        self.args_done = False


def _call_member(call: _Call, key: str, s: str, j: int) -> int:
    if key == "name":
        end = _value(s, j)
        if s[j] != '"':
            raise _Bad
        call.name = json.loads(s[j:end])
        return end
    if key in ("arguments", "parameters"):
        try:
            end = _value(s, j)
        except _End:
            call.args = s[j:]
            raise
        call.args, call.args_done = s[j:end], True
        return end
    return _value(s, j)


def scan(s: str) -> tuple[list[_Call], bool]:
    """The calls read from the partial answer `s` and whether the object is complete; _Bad when it is not the
    call object."""
    calls: list[_Call] = []
    bare: list[_Call] = []

    def call_at(j: int) -> int:
        c = _Call()
        calls.append(c)
        return _members(s, j, lambda k, v: _call_member(c, k, s, v))

    def top(key: str, j: int) -> int:
        if key == "tool_calls":
            if j >= len(s):
                raise _End
            if s[j] != "[":
                raise _Bad
            i = _ws(s, j + 1)
            if i < len(s) and s[i] == "]":
                return i + 1
            while True:
                i = _ws(s, call_at(_ws(s, i)))
                if i >= len(s):
                    raise _End
                if s[i] == "]":
                    return i + 1
                if s[i] != ",":
                    raise _Bad
                i += 1
        if key == "tool_call":
            return call_at(j)
        if key in ("name", "arguments", "parameters"):
            if not bare:
                bare.append(_Call())
                calls.append(bare[0])
            return _call_member(bare[0], key, s, j)
        return _value(s, j)

    try:
        end = _members(s, _ws(s, 0), top)
    except _End:
        return calls, False
    if s[_ws(s, end):]:
        raise _Bad
    return calls, True


class ToolCallStream:
    """One choice's answer: decides text or call, and turns a call answer's growth into tool-call deltas."""

    __slots__ = ("spec", "mode", "text", "ids", "sent_args", "streams_args")

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.mode = "call" if spec.choice in ("required", "function") else "undecided"  # | "text"
        self.text = ""  # the whole answer so far
        self.ids: list[str] = []  # ids of the calls announced
        self.sent_args: list[int] = []  # characters of each announced call's arguments sent
        self.streams_args: list[bool] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(text to send as content, tool-call deltas) for the next piece of the answer."""
        self.text += text
        if self.mode == "undecided":
            head = self.text.lstrip(_BLANK)
            if not head or HERMES_OPEN.startswith(head[:len(HERMES_OPEN)]) and len(head) < len(HERMES_OPEN):
                return "", []  # blanks, or maybe the start of a Hermes <tool_call>
            self.mode = "call" if head[0] == "{" or head.startswith(HERMES_OPEN) else "text"
            if self.mode == "text":
                return self.text, []
        if self.text.lstrip(_BLANK).startswith(HERMES_OPEN):
            return "", []  # Hermes calls are parsed and sent whole at the end
        if self.mode == "text":
            return text, []
        try:
            calls, _ = scan(self.text)
        except _Bad:
            return "", []
        return "", self._deltas(calls)

    def _deltas(self, calls: list[_Call]) -> list[dict]:
        out = []
        for k, c in enumerate(calls):
            if k == len(self.ids):
                if c.name is None:
                    break
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                self.streams_args.append(False)
                out.append({"index": k, "id": self.ids[k], "type": "function",
                            "function": {"name": c.name, "arguments": ""}})
            if not self.streams_args[k] and c.args[:1] == "{":
                self.streams_args[k] = True
            if self.streams_args[k] and len(c.args) > self.sent_args[k]:
                out.append({"index": k, "function": {"arguments": c.args[self.sent_args[k]:]}})
                self.sent_args[k] = len(c.args)
        return out

    def finish(self) -> tuple[str, list[dict], bool]:
        """At the end: (text still to send, last deltas, is it a call answer)."""
        if self.mode != "call":  # text went out as it came; an answer of blanks only is sent now
            return (self.text if self.mode == "undecided" else ""), [], False
        final = parse_answer(self.text, self.spec)
        if final is None:
            return ("" if self.ids else self.text), [], False
        out = []
        for k, call in enumerate(final):
            fn = call["function"]
            if k >= len(self.ids):
                self.ids.append(call["id"])
                self.sent_args.append(0)
                self.streams_args.append(False)
                out.append({"index": k, "id": call["id"], "type": "function",
                            "function": {"name": fn["name"], "arguments": ""}})
            if not self.streams_args[k]:  # arguments not sent as they came (not an object in the text): whole
                out.append({"index": k, "function": {"arguments": fn["arguments"]}})
                self.streams_args[k] = True
        return "", out, True


class ToolStreamEncoder(StreamEncoder):
    """StreamEncoder for a request with tools: text answers stream as text, call answers as tool-call deltas
    (without logprobs) and end with `finish_reason: "tool_calls"`."""

    __slots__ = ("answers",)

    def __init__(self, writer: ChunkWriter, choices: int, *, logprobs: bool, token_text: TokenText,
                 spec: ToolSpec) -> None:
        super().__init__(writer, choices, logprobs=logprobs, token_text=token_text)
        self.answers = [ToolCallStream(spec) for _ in range(choices)]

    def encode(self, i: int, batch: list[dict]) -> bytes:
        ans = self.answers[i]
        if ans.mode == "text":
            return super().encode(i, batch)
        toks = [ev for ev in batch if ev.get("ev") == "tokens"]
        end = batch[-1] if batch[-1].get("ev") != "tokens" else None
        text, deltas = ans.feed("".join(ev.get("text") or "" for ev in toks))
        if ans.mode == "text":  # decided now: this batch, with the blanks held back before it, as text
            first = dict(toks[0], text=text) if toks else {"ev": "tokens", "text": text}
            return super().encode(i, [first, *(dict(ev, text="") for ev in toks[1:]), *([end] if end else [])])
        if toks and any(ev.get("tokens") for ev in toks):
            self.started = True
        out = []
        w = self.writer
        if deltas:
            out.append(w.tool_calls(i, deltas))
        elif toks and end is None and ans.mode != "call":
            out.append(w.text(i, ""))  # the client hears of the tokens while text or call is undecided
        if end is not None:
            if end.get("ev") == "error":
                return super().encode(i, [end])
            rest, last, is_call = ans.finish()
            if rest:
                out.append(w.text(i, rest))
            if last:
                out.append(w.tool_calls(i, last))
            out.append(w.finish(i, "tool_calls" if is_call else end.get("finish_reason")))
            self.usages[i] = end.get("usage") or {}
            self.left -= 1
        return b"".join(out)
