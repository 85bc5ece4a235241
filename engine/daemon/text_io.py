"""Text in the daemon: the served model's tokenizer, and `text` prompts and string stops of requests.

The daemon tokenizes in its own process so clients need no tokenizer. The
tokenizer comes from the package the workers serve (`--package`, or the
built-in tiny model a `ref` worker reports it loaded); a backend without a
package (`stub`, `sim`, `ctypes`) uses the built-in byte-level vocabulary,
which is the layout those backends default to. Decoding is the core's
(`engine.core.text_stream`, fed `tokenizer.piece`), so a stop string can end
a request and free its lane like any other stop condition.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ipc.schema import MAX_PROMPT_TOKENS
from workers.backends.base import BackendInfo
from workers.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, load_tokenizer, tokenizer_spec


class TextRejected(Exception):
    """A request's text cannot be served (400): no tokenizer, or text that encodes to nothing usable."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def served_tokenizer(package_path: str | None, info: BackendInfo, package=None) -> Tokenizer | None:
    """The tokenizer of what the workers serve; None when the package has none (kind `none`).

    `package`: the package as the load already verified it (its files are not hashed again).
    Raises TokenizerError when the package's tokenizer cannot be loaded (the daemon does not start).
    """
    path = package_path or info.extra.get("package")
    if not path:
        return ByteTokenizer(info.vocab_size) if info.vocab_size >= 256 else None
    if package is None:
        from workers.package_loader import load_package

        package = load_package(path)
    if tokenizer_spec(package.manifest)["kind"] == "none":
        return None
    tok = load_tokenizer(package)
    if tok.vocab_size > info.vocab_size:
        raise TokenizerError(f"{path}: the tokenizer has {tok.vocab_size} ids but the model only "
                             f"{info.vocab_size}")
    return tok


def piece_function(tok: Tokenizer) -> Callable[[int], bytes]:
    """`tok.piece`, memoized: the core asks once per generated token, a vocabulary is finite."""
    return functools.lru_cache(maxsize=1 << 18)(tok.piece)


def split_stop(stop: list) -> tuple[list[list[int]], list[str]]:
    """The wire's mixed `stop` list as (token-id sequences, strings)."""
    return [s for s in stop if type(s) is list], [s for s in stop if type(s) is str]


def prompt_of(msg: dict, tok: Tokenizer | None) -> list[int]:
    """The prompt token ids of a validated generate: `prompt` as sent, or `text` encoded."""
    if "text" not in msg:
        return msg["prompt"]
    if tok is None:
        raise TextRejected("no_tokenizer", "text: this model has no tokenizer; send prompt token ids")
    ids = tok.encode(msg["text"])
    if not ids:
        raise TextRejected("out_of_range", "text: encodes to no tokens (send a non-empty text)")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise TextRejected("out_of_range", f"text: encodes to {len(ids)} tokens, more than {MAX_PROMPT_TOKENS}")
    return ids
