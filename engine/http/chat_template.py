"""The model's chat template (the GGUF's `tokenizer.chat_template`), rendered in a sandboxed Jinja2.

`ImmutableSandboxedEnvironment`: a template from a model file may not call
unsafe methods or mutate what it is given. The globals are the ones Hugging
Face's `apply_chat_template` provides (`raise_exception`, `strftime_now`,
`bos_token`, `eos_token`, `add_generation_prompt`, `messages`), which the
templates shipped in GGUF files expect.
"""

from __future__ import annotations

import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.http.openai_error import OpenAIError, bad


class TemplateError(Exception):
    """The template itself cannot be compiled (a broken model package)."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    import json

    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template; `render(messages)` -> the prompt text (special tokens as text)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"the model's chat template does not compile: {e}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True, extra: dict | None = None) -> str:
        """The prompt for `messages`; a template that refuses them (raise_exception) is a 400."""
        try:
            return self._template.render(**(extra or {}), messages=messages, bos_token=self.bos_token,
                                         eos_token=self.eos_token, add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:
            raise bad("messages", f"the model's chat template refused them: {e}", "template_error") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise bad("messages", f"the model's chat template cannot render them: {e}", "template_error") from None


def no_template(model: str) -> OpenAIError:
    return OpenAIError(400, f"model {model!r} has no chat template (its package has no tokenizer.chat_template); "
                            "use /v1/completions with a prompt you format yourself", param="messages",
                       code="no_chat_template")
