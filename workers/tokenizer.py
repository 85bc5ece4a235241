"""The tokenizer a model package carries, behind one small interface.

The daemon loads the tokenizer of the package it serves (in its own process)
so that clients can send and receive text without a tokenizer of their own.
Two kinds exist: `bytes` (the built-in tiny model: the UTF-8 bytes of the text
are the token ids) and `gguf` (llama.cpp's own tokenizer, a vocab-only load of
the package's GGUF file, in `workers.llamacpp.tokenizer`; imported only when
such a package is served, so the llama.cpp extra stays optional).

`piece(id)` is the bytes a token adds to the output text; a detokenizer joins
pieces as bytes and decodes UTF-8 incrementally (`engine.core.text_stream`),
because one character may be spread over several tokens.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

BYTES = "bytes"
GGUF = "gguf"
NONE = "none"
KINDS = (BYTES, GGUF, NONE)


class TokenizerError(Exception):
    """The package's tokenizer cannot be loaded; the message says why and what to do."""


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with BOS first when the model's metadata says so."""
        ...

    def piece(self, token_id: int) -> bytes:
        """The bytes this token contributes to the output text (b"" for special tokens)."""
        ...


class ByteTokenizer:
    """Byte-level vocabulary: ids 0..255 are the bytes; ids >= 256 (BOS, EOS, PAD, ...) carry no text."""

    def __init__(self, vocab_size: int, bos_id: int | None = None) -> None:
        if vocab_size < 256:
            raise TokenizerError(f"a byte-level tokenizer needs a vocabulary of at least 256 ids, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.bos_id = bos_id
        self._pieces = [bytes([i]) for i in range(256)]

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ids if self.bos_id is None else [self.bos_id, *ids]

    def piece(self, token_id: int) -> bytes:
        return self._pieces[token_id] if 0 <= token_id < 256 else b""


def tokenizer_spec(manifest: dict) -> dict:
    """The manifest's tokenizer section as a dict with a `kind`.

    Packages written before the section was a dict say `"tokenizer": "bytes"`
    (or `"none"`), and older ones say nothing: both mean byte-level when the
    vocabulary has room for the 256 bytes.
    """
    spec: Any = manifest.get("tokenizer")
    if spec is None:
        spec = {"kind": BYTES if int(manifest.get("vocab_size", 0)) >= 256 else NONE}
    elif isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, dict) or spec.get("kind") not in KINDS:
        raise TokenizerError(f"manifest tokenizer section {spec!r}: kind must be one of {', '.join(KINDS)}")
    return spec


def _gguf_file(package, spec: dict) -> str:
    name = spec.get("file")
    if name is None:
        ggufs = sorted(n for n in package.manifest.get("files", {}) if n.endswith(".gguf"))
        if len(ggufs) != 1:
            raise TokenizerError(f"{package.path}: a gguf tokenizer needs exactly one .gguf file in the package "
                                 f"(or tokenizer.file in the manifest), found {ggufs}")
        name = ggufs[0]
    if not isinstance(name, str) or os.path.basename(name) != name:
        raise TokenizerError(f"{package.path}: tokenizer.file must be a file name in the package, got {name!r}")
    return os.path.join(package.path, name)


def load_tokenizer(package) -> Tokenizer:
    """The tokenizer of a loaded package (`workers.model_package.ModelPackage` or anything with
    `.path` and `.manifest`). Raises TokenizerError (kind `none`, missing llama.cpp extra, bad file)."""
    spec = tokenizer_spec(package.manifest)
    kind = spec["kind"]
    if kind == BYTES:
        add_bos = spec.get("add_bos", False)
        if type(add_bos) is not bool:
            raise TokenizerError(f"{package.path}: tokenizer.add_bos must be true or false, got {add_bos!r}")
        return ByteTokenizer(int(package.manifest["vocab_size"]),
                             bos_id=int(package.manifest["bos_id"]) if add_bos else None)
    if kind == GGUF:
        path = _gguf_file(package, spec)
        try:
            from workers.llamacpp.tokenizer import GgufTokenizer
        except ImportError as e:
            raise TokenizerError(f"{package.path}: this package uses llama.cpp's tokenizer, which needs the "
                                 f"llamacpp backend and its extra (pip install -e '.[llamacpp]'): {e}") from e
        return GgufTokenizer(path)
    raise TokenizerError(f"{package.path}: the package has no tokenizer (tokenizer kind {kind!r}); "
                         f"send prompt token ids instead of text")
