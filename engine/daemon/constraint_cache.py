"""Compiling a request's `constraint` at admission, once per distinct constraint on this board.

The daemon turns the wire constraint (kind + body) into llguidance's grammar
text and validates it here, in its own process, before anything is queued:
a schema, regex or grammar that does not compile is a 400 naming the
problem. The result (`ConstraintSpec`: the grammar and its 64-bit hash) is
cached by the hash of (kind, body), so a repeated schema compiles once per
board; the workers compile each grammar once more against the model's
vocabulary (`workers.constraints`), keyed by the same id.

JSON schemas compile with compact separators (", ", ": ") and no free
whitespace between tokens (llguidance's `whitespace_flexible` off, which a
schema's own `x-guidance` may turn back on): a small model offered free
whitespace can spend its whole budget on newlines, and llama.cpp's server
restricts whitespace the same way.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import orjson

from engine.core.constraint_spec import ConstraintSpec

_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT = {"type": "object"}
_MAX_ENTRIES = 1024


class ConstraintRejected(ValueError):
    """The constraint does not compile; the message says why (the client's 400)."""


def grammar_of(kind: str, body) -> str:
    """llguidance grammar text for a wire constraint; raises ConstraintRejected when it does not compile."""
    import llguidance

    try:
        if kind in ("json_schema", "json_object"):
            schema = _ANY_OBJECT if kind == "json_object" else body
            if isinstance(schema, str):
                try:
                    schema = orjson.loads(schema)
                except orjson.JSONDecodeError as e:
                    raise ConstraintRejected(f"json_schema: the schema is not JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ConstraintRejected("json_schema: a schema must be a JSON object (or true/false)")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(body)
        elif kind == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(body)
        elif kind == "gbnf":
            grammar = llguidance.grammar_from("gbnf", body)
        else:
            raise ConstraintRejected(f"unknown constraint kind {kind!r}")
    except ConstraintRejected:
        raise
    except (ValueError, TypeError) as e:
        raise ConstraintRejected(f"{kind}: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ConstraintRejected(f"{kind}: {error.strip()}")
    return grammar


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") or 1


@dataclass
class ConstraintCache:
    """Compiled constraints by the hash of their wire form, least recently used evicted."""

    max_entries: int = _MAX_ENTRIES
    _entries: OrderedDict = field(default_factory=OrderedDict)
    compiles: int = 0
    hits: int = 0
    rejected: int = 0
    compile_s: list = field(default_factory=list)  # recent compile times (for the P50 in stats and bench)
    compile_s_total: float = 0.0

    def get(self, kind: str, body) -> ConstraintSpec:
        key = _hash64(orjson.dumps([kind, body], option=orjson.OPT_SORT_KEYS))
        spec = self._entries.get(key)
        if spec is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return spec
        t0 = time.perf_counter()
        try:
            grammar = grammar_of(kind, body)
        except ConstraintRejected:
            self.rejected += 1
            raise
        self.compile_s.append(time.perf_counter() - t0)
        self.compile_s_total += self.compile_s[-1]
        del self.compile_s[:-1024]
        self.compiles += 1
        spec = ConstraintSpec(id=_hash64(grammar.encode("utf-8")), grammar=grammar, kind=kind)
        self._entries[key] = spec
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return spec

    def stats(self) -> dict:
        times = sorted(self.compile_s)
        p50 = times[len(times) // 2] * 1000.0 if times else None
        return {"compiles": self.compiles, "hits": self.hits, "rejected": self.rejected,
                "cached": len(self._entries), "compile_ms_p50": p50, "compile_s_total": self.compile_s_total}


BOARD_CACHE = ConstraintCache()  # one daemon process serves one board
