"""A request's sampling penalties as the scheduler carries them to the chip.

presence/frequency/repetition penalties, logit bias, min_p and min_tokens
(vLLM's semantics: workers/penalties.py applies them). The daemon builds a
`PenaltySpec` from the validated wire fields at admission (`spec_of`), only
when some value is not neutral; the scheduler threads it onto each sampling
lane (`lane_penalty`). A request with one takes multi-step decode (the worker
advances its counts step by step, on the host or in a device loop that takes
penalties) but no queued next step or speculative drafts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ipc.lane_penalties import LanePenalty

# wire field -> its neutral value
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
           "min_tokens": 0, "logit_bias": {}}


@dataclass(frozen=True)
class PenaltySpec:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    bias_ids: tuple[int, ...] = ()  # ascending
    bias_values: tuple[float, ...] = ()


def set_fields(msg: Mapping) -> list[str]:
    """The penalty fields of a generate message that are not neutral (in NEUTRAL's order)."""
    return [k for k, v in NEUTRAL.items() if k in msg and msg[k] != v]


def spec_of(msg: Mapping) -> PenaltySpec | None:
    """The penalties of a validated generate message (ipc.schema), None when every one is neutral."""
    if not set_fields(msg):
        return None
    bias = sorted((int(k), float(v)) for k, v in msg.get("logit_bias", {}).items())
    return PenaltySpec(
        presence=float(msg.get("presence_penalty", 0.0)), frequency=float(msg.get("frequency_penalty", 0.0)),
        repetition=float(msg.get("repetition_penalty", 1.0)), min_p=float(msg.get("min_p", 0.0)),
        min_tokens=int(msg.get("min_tokens", 0)),
        bias_ids=tuple(i for i, _ in bias), bias_values=tuple(v for _, v in bias),
    )


def lane_penalty(spec: PenaltySpec, request_id: int, tokens: list[int], prompt_len: int, end: int,
                 prefill_target: int, stop_ids) -> LanePenalty:
    """The penalty of a sampling lane whose KV ends at `end`.

    The lane that ends the (re)prefill carries the tokens so far (prompt,
    then output: continuation included), the bias and `stop_ids` (what
    min_tokens masks), from which the worker rebuilds the counts; a decode
    lane carries the scalars and the output count only."""
    done = end - prompt_len
    rebuild = end == prefill_target
    return LanePenalty(
        key=request_id, done=done, presence=spec.presence, frequency=spec.frequency, repetition=spec.repetition,
        min_p=spec.min_p, min_tokens=spec.min_tokens, rebuild=rebuild,
        history=tokens[:end] if rebuild else (), bias_ids=spec.bias_ids if rebuild else (),
        bias_values=spec.bias_values if rebuild else (),
        stop_ids=tuple(sorted(stop_ids)) if rebuild and spec.min_tokens > done else (),
    )
