"""Wire checkers of the generate fields that shape sampling beyond temperature/top-p/top-k: penalties,
logit bias, min_p, min_tokens (vLLM's and OpenAI's ranges; docs/protocol.md). `ipc.schema` lists them."""

from __future__ import annotations

import math
import re
from typing import Any

MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_MAX = 100.0
_DECIMAL = re.compile(r"(0|[1-9][0-9]{0,9})\Z")


def logit_bias(name: str, value: Any, error, token_id_max: int) -> dict[str, float]:
    """{token id as a decimal string: bias in [-100, 100]} (OpenAI's spelling; JSON keys are strings).

    `error(reason, message)` makes the exception to raise. Whether the ids are in the model's vocabulary is
    the scheduler's check (it knows the model)."""
    if type(value) is not dict:
        raise error("bad_type", f"{name}: must be an object of token id -> bias, got {type(value).__name__}")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise error("out_of_range", f"{name}: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}")
    out: dict[str, float] = {}
    for k, v in value.items():
        if type(k) is not str or not _DECIMAL.match(k):
            raise error("bad_type", f"{name}: keys must be token ids written in decimal, got {str(k)[:40]!r}")
        if int(k) > token_id_max:
            raise error("out_of_range", f"{name}: token id {k} is outside [0, {token_id_max}]")
        if type(v) not in (int, float) or not math.isfinite(v):
            raise error("bad_type", f"{name}: the bias of token {k} must be a finite number, got {str(v)[:40]!r}")
        if not -LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX:
            raise error("out_of_range", f"{name}: the bias of token {k} must be in [-{LOGIT_BIAS_MAX:g}, "
                                        f"{LOGIT_BIAS_MAX:g}], got {v}")
        out[k] = float(v)
    return out
