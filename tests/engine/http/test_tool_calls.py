"""Tool calling without processes: the request's tools, the answer constraint, the parser, the prompt in the
generic format and the streaming chunker."""

from __future__ import annotations

import json

import jsonschema
import orjson
import pytest

from engine.daemon.constraint_cache import grammar_of
from engine.http.chat_template import ChatTemplate
from engine.http.openai_error import OpenAIError
from engine.http.openai_request import parse_chat, parse_completion
from engine.http.openai_response import ChunkWriter
from engine.http.tool_calls import parse_answer, parse_tools
from engine.http.tool_prompt import generic_messages, render, system_text, takes_tools
from engine.http.tool_stream import ToolCallStream, ToolStreamEncoder, scan

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}", "unit": "c"}}]}'


def _err(fn, *a) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(*a)
    return info.value


def _chat(**kw):
    return parse_chat({"messages": USER, **kw})


# -- the request ------------------------------------------------------------------------------------------
def test_tool_choice_forms_and_their_defaults():
    assert _chat(tools=TOOLS).tools.choice == "auto"
    assert _chat(tools=TOOLS).tools.parallel is True
    assert _chat().tools is None
    assert _chat(tool_choice="none").tools.active is False
    spec = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}},
                 parallel_tool_calls=True).tools
    assert (spec.choice, spec.function, spec.single) == ("function", "ping", True)
    assert [t.name for t in spec.callable_tools()] == ["ping"]
    assert _chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).tools.single
    # none offers nothing and constrains nothing; a response_format may then go beside the tools
    req = _chat(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"})
    assert req.sampling["constraint"]["kind"] == "json_object"


@pytest.mark.parametrize("body,param", [
    ({"tools": {}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools[1].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_fields_are_400s_naming_the_field(body, param):
    e = _err(lambda: _chat(**body))
    assert (e.status, e.param) == (400, param), e.message


def test_a_schema_that_does_not_compile_says_why():
    e = _err(lambda: _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]))
    assert "objectx" in e.message and e.code == "invalid_tool_schema"


def test_a_schema_nested_past_what_the_wire_carries_is_a_400():
    deep: dict = {"type": "object"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    e = _err(lambda: _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}]))
    assert e.param == "tools[0].function.parameters" and "nested" in e.message
    ok = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    assert _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": ok}}]).tools.tools[0].parameters \
        == ok


def test_completions_still_take_tools_only_at_their_neutral_value():
    assert parse_completion({"prompt": "x", "tools": [], "tool_choice": "auto"}).prompts == ["x"]
    assert _err(parse_completion, {"prompt": "x", "tools": TOOLS}).param == "tools"


def test_history_tool_calls_and_tool_messages_are_validated_and_kept():
    msgs = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    req = parse_chat({"messages": msgs, "tools": TOOLS})
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert req.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    bad = [dict(msgs[1], tool_calls=[{"function": {"name": "f", "arguments": 3}}])]
    assert _err(parse_chat, {"messages": USER + bad}).param == "messages[1].tool_calls[0].function.arguments"
    assert _err(parse_chat, {"messages": [dict(USER[0], tool_calls=msgs[1]["tool_calls"])]}).param == \
        "messages[0].tool_calls"


# -- the constraint -----------------------------------------------------------------------------------------
def test_required_constrains_to_calls_whose_arguments_follow_each_schema():
    spec = _chat(tools=TOOLS, tool_choice="required").tools
    c = spec.constraint()
    assert c["kind"] == "json_schema"
    grammar_of(c["kind"], c["body"])  # the daemon compiles it
    jsonschema.validate(json.loads(CALL), c["body"])
    for wrong in ('{"tool_calls": [{"name": "get_weather", "arguments": {"town": "x"}}]}',
                  '{"tool_calls": [{"name": "nope", "arguments": {}}]}', '{"tool_calls": []}'):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(wrong), c["body"])
    two = '{"tool_calls": [{"name": "ping", "arguments": {}}, {"name": "ping", "arguments": {}}]}'
    jsonschema.validate(json.loads(two), c["body"])
    single = _chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).tools.constraint()["body"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(two), single)
    named = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}}).tools
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(CALL), named.constraint()["body"])


def _matcher(grammar: str):
    import llguidance

    from workers.constraints import lltokenizer_for
    from workers.tokenizer import ByteTokenizer

    tok = lltokenizer_for(ByteTokenizer(257), 257, [256])
    return llguidance.LLMatcher(tok, grammar, log_level=0)


def _takes(m, text: str) -> bool:
    data = list(text.encode())
    return m.try_consume_tokens(data) == len(data)


def test_the_auto_grammar_takes_text_or_a_valid_call_and_nothing_in_between():
    c = _chat(tools=TOOLS).tools.constraint()
    grammar = grammar_of(c["kind"], c["body"])
    m = _matcher(grammar)
    assert _takes(m, "Hello {there}") and m.is_accepting()
    m = _matcher(grammar)
    assert _takes(m, CALL) and m.is_accepting()
    m = _matcher(grammar)
    assert not _takes(m, '{"tool_calls": [{"name": "nope"')
    m = _matcher(grammar)
    assert not _takes(m, '{"answer": 1}')
    m = _matcher(grammar)
    assert not _takes(m, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": 3')


# -- the answer ------------------------------------------------------------------------------------------
def test_parse_answer_takes_the_call_shapes_and_leaves_anything_else_as_text():
    spec = _chat(tools=TOOLS).tools
    [call] = parse_answer(CALL, spec)
    assert call["function"]["name"] == "get_weather" and call["type"] == "function"
    assert json.loads(call["function"]["arguments"]) == {"city": 'Pa"ris {x}', "unit": "c"}
    assert call["id"].startswith("call_") and len(call["id"]) > 10
    assert parse_answer(' {"tool_call": {"name": "ping", "arguments": {}}}\n', spec)[0]["function"]["name"] == "ping"
    assert parse_answer('{"name": "ping", "arguments": "{}"}', spec)[0]["function"]["arguments"] == "{}"
    for text in ("Sunny.", CALL[:-3], '{"tool_calls": [{"name": "nope", "arguments": {}}]}',
                 '{"tool_calls": [{"name": "ping", "arguments": [1]}]}', '{"x": 1}', "", "{"):
        assert parse_answer(text, spec) is None, text
    two = '{"tool_calls": [{"name": "ping", "arguments": {}}, {"name": "ping", "arguments": {}}]}'
    assert len(parse_answer(two, spec)) == 2
    assert parse_answer(two, _chat(tools=TOOLS, parallel_tool_calls=False).tools) is None


# -- the prompt -----------------------------------------------------------------------------------------------
GEMMA = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
NATIVE = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: "
          "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
          "{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m['content'] }}{% endif %}"
          "{% if m.name %} ({{ m.name }}){% endif %}\n{% endfor %}")
HISTORY = USER + [
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_a"},
    {"role": "tool", "content": "pong", "tool_call_id": "call_b"}]


def test_the_generic_format_describes_the_tools_in_the_system_turn():
    spec = _chat(tools=TOOLS).tools
    text = system_text(spec)
    assert '{"name": "get_weather", "description": "Weather in a city", "parameters": ' + json.dumps(WEATHER) in text
    assert '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}' in text
    assert "plain text" in text
    msgs = generic_messages([{"role": "system", "content": "Be brief."}] + USER, spec)
    assert msgs[0] == {"role": "system", "content": "Be brief.\n\n" + text}
    assert generic_messages(USER, spec)[0] == {"role": "system", "content": text}
    named = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}}).tools
    assert "get_weather" not in system_text(named) and "calling the tool ping" in system_text(named)
    assert generic_messages(USER, _chat(tools=TOOLS, tool_choice="none").tools) == USER


def test_the_generic_format_writes_calls_as_the_answer_and_results_as_one_user_turn():
    msgs = generic_messages(HISTORY, None)
    assert msgs[1] == {"role": "assistant", "content": json.dumps({"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "ping", "arguments": {}}]})}
    assert msgs[2] == {"role": "user", "content": "\n".join([
        json.dumps({"tool_response": {"tool_call_id": "call_a", "name": "get_weather", "content": "sunny"}}),
        json.dumps({"tool_response": {"tool_call_id": "call_b", "name": "ping", "content": "pong"}})])}
    assert len(msgs) == 3
    prompt = render(ChatTemplate(GEMMA), HISTORY, _chat(tools=TOOLS).tools, True, {})
    assert prompt.count("<start_of_turn>user") == 2 and "<start_of_turn>tool" not in prompt


def test_a_template_that_takes_tools_renders_them_itself():
    t = ChatTemplate(NATIVE)
    assert takes_tools(t) and not takes_tools(ChatTemplate(GEMMA))
    prompt = render(t, HISTORY, _chat(tools=TOOLS).tools, False, {})
    assert prompt.startswith("TOOLS [{") and '"name": "get_weather"' in prompt.splitlines()[0]
    assert 'CALL get_weather {"city": "Paris"}' in prompt  # arguments as an object, as HF templates expect
    assert "tool: sunny (get_weather)" in prompt and "<tool name>" not in prompt
    assert not render(t, USER, _chat(tools=TOOLS, tool_choice="none").tools, False, {}).startswith("TOOLS")


# -- streaming ------------------------------------------------------------------------------------------------
def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_the_chunker_sends_id_and_name_first_then_fragments_that_assemble_to_the_call(size):
    spec = _chat(tools=TOOLS).tools
    two = CALL[:-2] + ', {"name": "ping", "arguments": {}}]}'
    s = ToolCallStream(spec)
    deltas = []
    for p in _pieces(two, size):
        text, d = s.feed(p)
        assert text == ""
        deltas += d
    rest, last, is_call = s.finish()
    assert is_call and rest == "" and last == []
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["function"]["arguments"] == ""
            calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "args": ""}
        else:
            calls[d["index"]]["args"] += d["function"]["arguments"]
    assert [(c["name"], json.loads(c["args"])) for c in calls.values()] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parse_answer(two, spec)]


def test_the_chunker_sends_text_as_text_and_an_unparsable_call_as_text():
    spec = _chat(tools=TOOLS).tools
    s = ToolCallStream(spec)
    assert s.feed("\n ") == ("", [])
    assert s.feed("Hi {") == ("\n Hi {", [])
    assert s.feed("there") == ("there", [])
    assert s.finish() == ("", [], False)
    s = ToolCallStream(spec)
    assert s.feed("\n") == ("", []) and s.finish() == ("\n", [], False)
    s = ToolCallStream(spec)
    assert s.feed('{"tool_calls": [{"na') == ("", [])
    assert s.finish() == ('{"tool_calls": [{"na', [], False)  # cut short before any call went out: text
    s = ToolCallStream(spec)
    s.feed('{"tool_calls": [{"name": "ping", "argu')
    assert s.finish() == ("", [], False)  # a call went out: the stream ends with the upstream's reason


def test_hermes_tool_call_blocks_are_calls_parsed_after_the_fact_and_streamed_whole():
    spec = _chat(tools=TOOLS).tools
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
             '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    calls = parse_answer(hermes, spec)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("ping", {})]
    for text in ("<tool_call>{\"name\": \"ping\"}", hermes + " and more", "<tool_call>x</tool_call>",
                 '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'):
        assert parse_answer(text, spec) is None, text
    s = ToolCallStream(spec)
    for p in _pieces(hermes, 4):
        assert s.feed(p) == ("", [])
    rest, last, is_call = s.finish()
    assert is_call and rest == "" and [d["function"]["name"] for d in last if "id" in d] == ["get_weather", "ping"]
    assert json.loads(last[1]["function"]["arguments"]) == {"city": "Paris"}
    s = ToolCallStream(spec)
    assert s.feed("<tool") == ("", []) and s.feed("s are") == ("<tools are", [])  # not a call after all


def test_scan_reads_partial_answers_and_rejects_other_objects():
    calls, done = scan('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa')
    assert not done and calls[0].name == "get_weather" and calls[0].args == '{"city": "Pa'
    calls, done = scan('{"tool_call": {"arguments": {"a": [1, {"b": "}"}]}, "name": "x"}}')
    assert done and calls[0].args_done and calls[0].args == '{"a": [1, {"b": "}"}]}' and calls[0].name == "x"
    from engine.http.tool_stream import _Bad

    with pytest.raises(_Bad):
        scan('{"tool_calls": {"name"')
    with pytest.raises(_Bad):
        scan('{"a": 1} x')


def _events(data: bytes) -> list[dict]:
    return [orjson.loads(line[6:]) for line in data.split(b"\n\n") if line.startswith(b"data: {")]


def test_the_stream_encoder_ends_a_call_answer_with_finish_reason_tool_calls():
    spec = _chat(tools=TOOLS, tool_choice="required").tools
    enc = ToolStreamEncoder(ChunkWriter("chat", "chatcmpl-x", "m", False, created=1), 1, logprobs=False,
                            token_text=str, spec=spec)
    out = enc.head()
    for p in _pieces(CALL, 9):
        out += enc.encode(0, [{"ev": "tokens", "text": p, "tokens": [1]}])
    out += enc.encode(0, [{"ev": "done", "finish_reason": "eos", "usage": {}}])
    evs = _events(out)
    assert evs[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [d for e in evs for d in e["choices"][0]["delta"].get("tool_calls", ())]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == json.loads(CALL)["tool_calls"][0][
        "arguments"]
    assert evs[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(e["choices"][0]["delta"].get("content") for e in evs)
    assert enc.left == 0


def test_the_stream_encoder_passes_a_text_answer_through():
    enc = ToolStreamEncoder(ChunkWriter("chat", "chatcmpl-x", "m", False, created=1), 1, logprobs=False,
                            token_text=str, spec=_chat(tools=TOOLS).tools)
    out = enc.encode(0, [{"ev": "tokens", "text": " ", "tokens": [1]}])
    out += enc.encode(0, [{"ev": "tokens", "text": "Hi", "tokens": [2]}, {"ev": "tokens", "text": "!", "tokens": [3]}])
    out += enc.encode(0, [{"ev": "done", "finish_reason": "stop", "usage": {}}])
    evs = _events(out)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in evs) == " Hi!"
    assert evs[-1]["choices"][0]["finish_reason"] == "stop"
