"""What the front knows of the served model: alias, context, chat template and tokenizer.

The upstream's `models` reply names the model and, on a board daemon, the
package folder it serves (`package`); `--package` overrides it (an upstream
on another host). The package gives the chat template (manifest
`tokenizer.chat_template`, copied from the GGUF's `tokenizer.chat_template`
by `npuserve import-gguf`) and the tokenizer, which the front needs to turn a
rendered chat prompt into token ids (the template's control tokens are
parsed as such there, never in user text sent as `text`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from engine.http.chat_template import ChatTemplate, TemplateError
from engine.http.openai_error import OpenAIError


@dataclass
class ServedModel:
    alias: str
    max_seq: int
    vocab_size: int
    package: str | None
    sha256: str | None = None  # the upstream's package identity when this view was built
    template: ChatTemplate | None = None
    tokenizer: object | None = None  # workers.tokenizer.Tokenizer (+ encode_template for GGUF ones)
    problem: str = ""  # why there is no template/tokenizer (shown in the 400)
    chat_template: str = ""  # where the template comes from: "package", "--chat-template", "llama.cpp built-in ..."

    def token_text(self, token_id: int) -> str:
        """A generated token as logprobs show it: its text, or `token_id:N` without a tokenizer (as vLLM)."""
        tok = self.tokenizer
        if tok is None:
            return f"token_id:{token_id}"
        return tok.piece(token_id).decode("utf-8", errors="replace")

    def chat_prompt(self, text: str) -> list[int]:
        """Token ids of a rendered chat prompt (control tokens parsed; BOS once, where the model wants it)."""
        tok = self.tokenizer
        encode = getattr(tok, "encode_template", None)
        if encode is None:
            raise OpenAIError(400, f"model {self.alias!r}: its tokenizer cannot parse a chat template's control "
                                   "tokens", param="messages", code="no_chat_template")
        ids = encode(text)
        bos = getattr(tok, "bos_id", None)
        if getattr(tok, "add_bos", False) and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids


def _family_template(manifest: dict) -> str | None:
    """llama.cpp's built-in template for the package's model family (None: not a known family)."""
    try:
        from workers.llamacpp.chat_builtin import family_template
    except ImportError:
        return None
    return family_template(manifest.get("architecture"))


@dataclass(frozen=True)
class _Package:
    """What `workers.tokenizer.load_tokenizer` reads of a package."""

    path: str
    manifest: dict


def read_manifest(path: str) -> tuple[dict, str]:
    """A package's manifest and its sha256 (the package identity the upstream reports as `sha256`).

    The daemon verified the package's files against this manifest when it loaded them; matching the
    identity is enough here, without hashing the model file again."""
    from workers.package_manifest import MANIFEST

    with open(os.path.join(path, MANIFEST), "rb") as fh:
        raw = fh.read()
    return json.loads(raw), hashlib.sha256(raw).hexdigest()


def load_served_model(info: dict, package_override: str | None = None,
                      template_override: str | None = None) -> ServedModel:
    """Build the view of one `models` entry; reads the package (blocking: run it in a thread).

    `template_override`: a chat template (Jinja2 source) to use instead of the package's (`--chat-template`),
    for models whose GGUF carries none."""
    from workers.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer, tokenizer_spec

    path = package_override or info.get("path") or info.get("package") or None
    m = ServedModel(alias=str(info.get("alias", "")), max_seq=int(info.get("max_seq") or 0),
                    vocab_size=int(info.get("vocab_size") or 0), package=path, sha256=info.get("sha256"))
    if not path:
        m.tokenizer = ByteTokenizer(m.vocab_size) if m.vocab_size >= 256 else None
        m.problem = "the upstream serves no model package (stub/sim backend)"
        return m
    try:
        manifest, digest = read_manifest(path)
        if info.get("sha256") and digest != info["sha256"]:
            m.problem = (f"the package {path} (manifest sha256 {digest[:12]}) is not the one the upstream serves "
                         f"({str(info['sha256'])[:12]})")
            return m
        spec = tokenizer_spec(manifest)
        if spec["kind"] != "none":
            m.tokenizer = load_tokenizer(_Package(path, manifest))
    except (TokenizerError, OSError, ValueError) as e:
        m.problem = f"cannot read the model package {path}: {e}"
        return m
    source = template_override or spec.get("chat_template")
    tok = m.tokenizer
    if not source:
        family = _family_template(manifest) if getattr(tok, "encode_template", None) else None
        if family is None:
            m.problem = "its package has no tokenizer.chat_template (give the front one with --chat-template FILE)"
            return m
        from workers.llamacpp.chat_builtin import BuiltinChatTemplate

        m.template = BuiltinChatTemplate(family)
        m.chat_template = f"{m.template.source} (the package has none; architecture {manifest.get('architecture')})"
        return m
    m.chat_template = "--chat-template" if template_override else "package"
    text_of = getattr(tok, "token_text", None)
    bos = text_of(tok.bos_id) if text_of and getattr(tok, "bos_id", None) is not None else ""
    eos = text_of(tok.eos_id) if text_of and getattr(tok, "eos_id", None) is not None else ""
    try:
        m.template = ChatTemplate(source, bos, eos)
    except TemplateError as e:
        m.problem = str(e)
    return m
