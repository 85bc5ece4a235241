"""Chat templates in the sandbox (engine.http.chat_template) and API key files (engine.http.api_keys)."""

from __future__ import annotations

import os

import pytest

from engine.http.api_keys import ApiKeys, KeyFileError, parse_key_file
from engine.http.chat_template import ChatTemplate, TemplateError
from engine.http.openai_error import OpenAIError

GEMMA = open(os.path.join(os.path.dirname(__file__), "gemma_chat_template.jinja")).read()


def test_the_gemma_format_template_renders_turns():
    t = ChatTemplate(GEMMA, "<bos>", "<eos>")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert t.render(msgs) == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
                              "Hello!<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert not t.render(msgs, add_generation_prompt=False).endswith("<start_of_turn>model\n")


def test_hugging_face_globals_are_there():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('users first') }}{% endif %}"
                     "{{ messages | tojson }}{{ strftime_now('%Y') | length }}{{ eos_token }}{{ extra }}")
    assert t.render([{"role": "user", "content": "é"}], extra={"extra": "!"}) == \
        '[{"role": "user", "content": "é"}]4!'
    with pytest.raises(OpenAIError) as e:
        t.render([{"role": "system", "content": "x"}])
    assert e.value.status == 400 and "users first" in e.value.message


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
])
def test_the_sandbox_refuses_unsafe_or_mutating_templates(source):
    with pytest.raises(OpenAIError) as e:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert e.value.status == 400 and e.value.code == "template_error"


def test_a_template_that_does_not_compile():
    with pytest.raises(TemplateError):
        ChatTemplate("{% for %}")


def test_key_file_and_lookup():
    keys = ApiKeys(parse_key_file("# comment\n\nsk-aaaaaaaa alice\n  sk-bbbbbbbb   bob  \nsk-cccccccc alice\n"))
    assert keys.tenant_for("Bearer sk-aaaaaaaa") == "alice"
    assert keys.tenant_for("bearer sk-bbbbbbbb") == "bob"
    for header in (None, "", "Bearer", "Basic sk-aaaaaaaa", "Bearer sk-nope0000"):
        with pytest.raises(OpenAIError) as e:
            keys.tenant_for(header)
        assert e.value.status == 401 and e.value.type == "authentication_error"


@pytest.mark.parametrize("text,why", [("sk-aaaaaaaa", "KEY TENANT"), ("short alice", "at least"),
                                      ("sk-aaaaaaaa al/ice", "tenant"), ("sk-aaaaaaaa a\nsk-aaaaaaaa b", "twice"),
                                      ("# nothing\n", "no keys")])
def test_bad_key_files(text, why):
    with pytest.raises(KeyFileError) as e:
        parse_key_file(text, "keys")
    assert why in str(e.value)
