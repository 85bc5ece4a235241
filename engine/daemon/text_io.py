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

from engine.config import ModelConfig
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


# Token ids whose bytes the daemon keeps (`model.piece_cache_entries`). The core asks for every generated
# token's bytes; a GGUF tokenizer answers from llama.cpp's own table (a call of ~1-2 us), so the cache only
# saves that call for the common tokens. An entry costs ~200 bytes (the id, the bytes, the LRU node), so
# 1,024 entries hold at most ~0.2 MiB and fill within a few hundred requests of a real model (a cache that
# takes longer to fill than a soak's warm-up reads as a leak until it is full); left unbounded over Gemma 3's
# 262,144 ids the cache grew ~2.7 KB per request and would have reached ~50 MiB.
DEFAULT_PIECE_CACHE_ENTRIES = ModelConfig.piece_cache_entries


def piece_function(tok: Tokenizer, max_entries: int = DEFAULT_PIECE_CACHE_ENTRIES) -> Callable[[int], bytes]:
    """`tok.piece` behind an LRU cache of at most `max_entries` token ids (0: no cache);
    `piece_cache_stats` reads its figures."""
    return functools.lru_cache(maxsize=max(0, max_entries))(tok.piece)


def piece_cache_stats(piece) -> dict | None:
    """entries / max_entries / hits / misses of a `piece_function` (None: no tokenizer, nothing cached)."""
    info = getattr(piece, "cache_info", None)
    if info is None:
        return None
    i = info()
    return {"entries": i.currsize, "max_entries": i.maxsize, "hits": i.hits, "misses": i.misses}


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
