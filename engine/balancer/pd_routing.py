"""Prefill/decode disaggregation in the balancer: which stage a request is in, who may serve it, what is sent.

Pure functions over the core's backends and messages (no I/O). With at least
one `prefill` and one `decode` backend the balancer runs each request in two
legs and keeps the client's one stream across them:

    PREFILL  to a prefill board (prefix- and load-aware: the routing policy), max_tokens = one more
             token, `handoff: {"export": true}`; its first token goes to the client at once (TTFT)
    DECODE   to a decode board (least load, then KV headroom): the request again, with the tokens
             streamed so far as `continuation` and the prefill board's hand-off descriptor; the decode
             board imports the prompt's KV when it can and recomputes it otherwise

A prefill leg that ends the request (EOS, a stop token, max_tokens reached)
ends it there. When no prefill board is routable the request goes WHOLE to a
decode board (co-located), and a decode leg whose board is lost migrates to
another decode board like any broken stream, so no request is lost to a
missing role. A request with stop sequences is not shown its first token from
the prefill leg: a stop sequence could begin with it, and a co-located run
would have held it back; its decode leg re-samples that token (seeded
sampling is keyed by (seed, position), so it is the same token).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from engine.balancer.backend_state import Backend

ROLES = ("mixed", "prefill", "decode")
KV_FULL = 0.95  # a decode board reporting this KV use or more is passed over while another has room


class Stage(enum.Enum):
    WHOLE = "whole"  # one backend serves the whole request (no disaggregation, or a fallback)
    PREFILL = "prefill"
    DECODE = "decode"


def pd_enabled(backends: Sequence[Backend]) -> bool:
    roles = {b.spec.role for b in backends if not b.removed}
    return "prefill" in roles and "decode" in roles


def first_stage(msg: dict, streamed: int, enabled: bool, min_prompt: int = 0) -> Stage:
    """A request worth splitting starts at a prefill board: it wants more than the one token a prefill leg
    gives, and its prompt (with any continuation) is at least `min_prompt` tokens, the length from which a
    hand-off costs the decode board less than computing the prompt itself (engine/balancer/pd_cost.py).
    A text prompt's length is not known here (the board tokenizes it): it is split."""
    left = int(msg.get("max_tokens", 1)) - len(msg.get("continuation") or ()) - streamed
    if not enabled or left <= 1:
        return Stage.WHOLE
    prompt = msg.get("prompt")
    if min_prompt > 0 and isinstance(prompt, list) and len(prompt) + len(msg.get("continuation") or ()) < min_prompt:
        return Stage.WHOLE
    return Stage.PREFILL


def for_stage(cands: Sequence[Backend], stage: Stage, enabled: bool) -> list[Backend]:
    """The candidates of a stage: its role (mixed boards too); WHOLE prefers decode/mixed boards."""
    if not enabled:
        return list(cands)
    if stage is Stage.PREFILL:
        return [b for b in cands if b.spec.role in ("prefill", "mixed")]
    return [b for b in cands if b.spec.role in ("decode", "mixed")]


def choose_decode(cands: Sequence[Backend]) -> Backend:
    """Least load per unit of weight, then the most KV headroom; a board near full KV only when all are."""
    def kv_used(b: Backend) -> float:
        load = b.reported.get("load")
        v = load.get("kv_used") if isinstance(load, dict) else None
        return float(v) if isinstance(v, (int, float)) else 0.0

    roomy = [b for b in cands if kv_used(b) < KV_FULL] or list(cands)
    best = min(roomy, key=lambda b: (b.load() / b.spec.weight, kv_used(b), b.picks, b.name))
    if len(roomy) > 1:
        best.picks += 1
    return best


def shows_first_token(msg: dict) -> bool:
    """May the prefill leg's token go to the client at once? Not when a stop sequence could begin with it."""
    return not msg.get("stop")


def prefill_msg(m: dict, continuation: list[int]) -> dict:
    """The prefill leg of upstream message `m` (already with its id, stream and deadline)."""
    m = dict(m)
    m["max_tokens"] = len(continuation) + 1 if m.get("max_tokens") != 0 else 0  # 0: the prompt's logprobs only
    if m.get("min_tokens", 0) > m["max_tokens"]:  # the decode leg honours the rest
        m["min_tokens"] = m["max_tokens"]
    if continuation:
        m["continuation"] = continuation
    m["handoff"] = {"export": True}
    return m


def decode_msg(m: dict, handoff: dict | None) -> dict:
    m = dict(m)
    m.pop("prompt_logprobs", None)  # the prefill leg computed the prompt and answered them
    if handoff is not None:
        m["handoff"] = handoff
    return m


def continues_after_prefill(finish_reason: str, msg: dict, streamed: int) -> bool:
    """A prefill leg that stopped on length with tokens still wanted hands off; EOS/stop/cancel end the request."""
    left = int(msg.get("max_tokens", 1)) - len(msg.get("continuation") or ()) - streamed
    return finish_reason == "length" and left > 0
