"""Admission rules: the capacity budget and its five outcomes.

`decide_submit` runs when a request arrives: requests that can never be
served are rejected at once (400), overload is pushed back to the client
(429) instead of growing an unbounded queue, and a draining scheduler says
so (503).  Everything else is queued; KV is reserved later, at a tick.

The waiting room is bounded in time as well as in size: with
admission.max_queue_wait_ms a request that has waited that long is failed
with 429 `queue_wait_exceeded` (the scheduler's tick, in arrival order), and
a new request is turned away at once while the oldest one of the lane it
would join has waited that long already (it would wait at least as long).
A request is queued only while there is hope of serving it in time; a burst
is pushed back fast, retryable, for a balancer to place elsewhere.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from engine.core.requests import GenerateParams
from ipc.logprob_wants import MAX_TOP


class AdmissionOutcome(enum.Enum):
    ADMIT = "admit"
    QUEUE = "queue"
    REJECT_INVALID = "reject_invalid"  # 400
    REJECT_CAPACITY = "reject_capacity"  # 429
    REJECT_UNAVAILABLE = "reject_unavailable"  # 503


HTTP_CODE = {
    AdmissionOutcome.REJECT_INVALID: 400,
    AdmissionOutcome.REJECT_CAPACITY: 429,
    AdmissionOutcome.REJECT_UNAVAILABLE: 503,
}


@dataclass(frozen=True)
class CapacityBudget:
    max_sequences: int
    # KV tokens the admitted sequences may hold reserved, board-wide (admission.max_kv_tokens); None when
    # it is not below the pool, whose blocks the chips count themselves
    max_kv_tokens: int | None
    max_waiting_requests: int
    max_waiting_prompt_tokens: int
    max_inflight_jobs: int
    # admission.max_queue_wait_ms in seconds: how long a request may wait for admission; 0 = unbounded
    max_queue_wait_s: float = 0.0


@dataclass(frozen=True)
class AdmissionDecision:
    outcome: AdmissionOutcome
    reason: str = ""
    message: str = ""

    @property
    def code(self) -> int:
        return HTTP_CODE.get(self.outcome, 200)

    @property
    def retryable(self) -> bool:
        return self.outcome in (AdmissionOutcome.REJECT_CAPACITY, AdmissionOutcome.REJECT_UNAVAILABLE)


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_seq: int
    max_blocks_per_chip: int  # the largest chip's pool
    block_size: int


def validate_params(p: GenerateParams, limits: ModelLimits) -> AdmissionDecision | None:
    """A 400 decision for a request that can never be served, else None."""

    def bad(reason: str, message: str) -> AdmissionDecision:
        return AdmissionDecision(AdmissionOutcome.REJECT_INVALID, reason, message)

    if not p.prompt:
        return bad("empty_prompt", "the prompt is empty")
    if p.max_tokens < (0 if p.prompt_logprobs is not None else 1):
        return bad("invalid_max_tokens", "max_tokens must be >= 1 (0 only with prompt_logprobs)")
    if not 0 <= p.top_logprobs <= MAX_TOP or not 0 <= (p.prompt_logprobs or 0) <= MAX_TOP:
        return bad("invalid_logprobs", f"top_logprobs and prompt_logprobs must be in 0..{MAX_TOP}")
    for name, toks in (("prompt", p.prompt), ("continuation", p.continuation), ("stop_token_ids", p.stop_token_ids)):
        for t in toks:
            if not 0 <= int(t) < limits.vocab_size:
                return bad("token_out_of_range", f"{name} token {t} is outside [0, {limits.vocab_size})")
    for s in p.stop:
        for t in s:
            if not 0 <= int(t) < limits.vocab_size:
                return bad("token_out_of_range", f"stop sequence token {t} is outside [0, {limits.vocab_size})")
    pen = p.penalties
    if pen is not None:
        for t in pen.bias_ids:
            if not 0 <= t < limits.vocab_size:
                return bad("token_out_of_range", f"logit_bias: token id {t} is outside [0, {limits.vocab_size})")
        if pen.min_tokens > p.max_tokens:
            return bad("invalid_min_tokens", f"min_tokens: must be at most max_tokens ({p.max_tokens}), got "
                                             f"{pen.min_tokens}")
    if len(p.continuation) > p.max_tokens:
        return bad("continuation_too_long", "continuation is longer than max_tokens")
    total = len(p.prompt) + p.max_tokens
    if total > limits.max_seq:
        return bad("context_too_long", f"prompt ({len(p.prompt)}) + max_tokens ({p.max_tokens}) exceeds max_seq {limits.max_seq}")
    if math.ceil(total / limits.block_size) > limits.max_blocks_per_chip:
        return bad("context_too_long", "the request needs more KV blocks than a chip has")
    if not (p.temperature >= 0 and 0 < p.top_p <= 1 and p.top_k >= 0):
        return bad("invalid_sampling", "temperature must be >= 0, top_p in (0, 1], top_k >= 0")
    if p.deadline_ms is not None and p.deadline_ms <= 0:
        return bad("invalid_deadline", "deadline_ms must be > 0")
    return None


@dataclass
class WaitingLoad:
    requests: int
    prompt_tokens: int
    tenant_tokens: int
    # how long the oldest request of the lane the new one joins (its tenant's queue) has waited; 0: none waits
    oldest_wait_s: float = 0.0


def queue_wait_exceeded(max_queue_wait_s: float, head: bool) -> AdmissionDecision:
    """The 429 of admission.max_queue_wait_ms: the request's own wait ran out (at a tick), or (`head`, at submit)
    the oldest request of its lane has already waited that long."""
    ms = round(max_queue_wait_s * 1000)
    message = (f"the queue's oldest request has already waited admission.max_queue_wait_ms ({ms} ms)" if head
               else f"waited admission.max_queue_wait_ms ({ms} ms) without being admitted")
    return AdmissionDecision(AdmissionOutcome.REJECT_CAPACITY, "queue_wait_exceeded", message)


def decide_submit(p: GenerateParams, limits: ModelLimits, budget: CapacityBudget, accepting: bool,
                  unavailable_reason: str, waiting: WaitingLoad, tenant_cap_tokens: int | None) -> AdmissionDecision:
    invalid = validate_params(p, limits)
    if invalid is not None:
        return invalid
    n = len(p.prompt) + len(p.continuation)
    reserve = min(n + 1, limits.max_seq)  # what admission reserves: the prompt and the first decode position
    if budget.max_kv_tokens is not None and reserve > budget.max_kv_tokens:
        return AdmissionDecision(AdmissionOutcome.REJECT_INVALID, "context_too_long",
                                 f"the prompt needs {reserve} KV tokens, more than admission.max_kv_tokens "
                                 f"({budget.max_kv_tokens})")
    if not accepting:
        return AdmissionDecision(AdmissionOutcome.REJECT_UNAVAILABLE, unavailable_reason, "not accepting new requests")
    if waiting.requests + 1 > budget.max_waiting_requests:
        return AdmissionDecision(AdmissionOutcome.REJECT_CAPACITY, "queue_full", "too many waiting requests")
    if waiting.prompt_tokens + n > budget.max_waiting_prompt_tokens:
        return AdmissionDecision(AdmissionOutcome.REJECT_CAPACITY, "queue_tokens_full", "too many waiting prompt tokens")
    if tenant_cap_tokens is not None and waiting.tenant_tokens + n > tenant_cap_tokens:
        return AdmissionDecision(AdmissionOutcome.REJECT_CAPACITY, "tenant_quota", "tenant's waiting-token quota is full")
    if 0 < budget.max_queue_wait_s <= waiting.oldest_wait_s:
        return queue_wait_exceeded(budget.max_queue_wait_s, head=True)
    return AdmissionDecision(AdmissionOutcome.QUEUE)
