"""OpenAI's and vLLM's penalty fields of a request body -> the wire's (pure; 400s name the field).

`presence_penalty`, `frequency_penalty` and `logit_bias` are OpenAI's; `repetition_penalty`, `min_p` and
`min_tokens` are vLLM's extensions (the `openai` client sends them in `extra_body`, i.e. at the top level of
the body). Null means absent. Semantics: docs/http.md.
"""

from __future__ import annotations

from typing import Any

from engine.http import kv_transfer
from engine.http.openai_error import OpenAIError, bad
from ipc import sampling_fields

FIELDS = frozenset({"presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                    "logit_bias"})
_TOKEN_ID_MAX = 2**31 - 1
MAX_TOKENS = 1 << 20


def _number(name: str, v: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if type(v) not in (int, float) or v != v or v in (float("inf"), float("-inf")):
        raise bad(name, f"must be a number, got {v!r}", "invalid_type")
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise bad(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}")
    return float(v)


class _BiasError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def penalty_fields(body: dict) -> dict:
    """The wire fields of the body's penalties (only those it sets)."""
    out: dict = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            out[name] = _number(name, body[name], -2.0, 2.0)
    if body.get("repetition_penalty") is not None:
        out["repetition_penalty"] = _number("repetition_penalty", body["repetition_penalty"], 0.0, 100.0,
                                            lo_open=True)
    if body.get("min_p") is not None:
        out["min_p"] = _number("min_p", body["min_p"], 0.0, 1.0)
    mt = body.get("min_tokens")
    if mt is not None:
        if type(mt) is not int:
            raise bad("min_tokens", f"must be an integer, got {mt!r}", "invalid_type")
        if not 0 <= mt <= MAX_TOKENS:
            raise bad("min_tokens", f"must be in [0, {MAX_TOKENS}], got {mt}")
        if not (mt == 1 and kv_transfer.is_prefill_leg(body)):  # vllm-router's prefill leg: one token, dropped
            out["min_tokens"] = mt
    if body.get("logit_bias") is not None:
        try:
            bias = sampling_fields.logit_bias("logit_bias", body["logit_bias"], _BiasError, _TOKEN_ID_MAX)
        except _BiasError as e:
            raise OpenAIError(400, str(e), param="logit_bias",
                              code="invalid_type" if e.reason == "bad_type" else "invalid_value") from None
        if bias:
            out["logit_bias"] = bias
    return out
