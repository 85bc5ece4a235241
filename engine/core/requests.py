"""Requests as the scheduler sees them: parameters, lifecycle states, legal moves.

The state machine is explicit so that a bug shows up as an assertion at the
transition that should not have happened, not as a request that silently got
two terminal events (every accepted request gets exactly one).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.core.constraint_spec import ConstraintSpec
from engine.core.penalty_spec import PenaltySpec


class RequestState(enum.Enum):
    NEW = "new"
    WAITING_ADMISSION = "waiting_admission"
    PREFILL_READY = "prefill_ready"
    PREFILL_RUNNING = "prefill_running"
    DECODE_READY = "decode_ready"
    DECODE_RUNNING = "decode_running"
    FINISHING = "finishing"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"

    __hash__ = object.__hash__  # members are singletons; Enum's name hash is slow on the hot path


TERMINAL_STATES = frozenset({RequestState.COMPLETED, RequestState.CANCELLED, RequestState.FAILED})

_S = RequestState
# Every live state may end in CANCELLED or FAILED; listed here are the forward
# moves plus the requeue edge (-> WAITING_ADMISSION) taken on preemption and
# on a chip fault before any token was emitted.
_LEGAL: dict[RequestState, frozenset[RequestState]] = {
    _S.NEW: frozenset({_S.WAITING_ADMISSION}),
    _S.WAITING_ADMISSION: frozenset({_S.PREFILL_READY}),
    _S.PREFILL_READY: frozenset({_S.PREFILL_RUNNING, _S.WAITING_ADMISSION}),
    _S.PREFILL_RUNNING: frozenset({_S.PREFILL_READY, _S.DECODE_READY, _S.FINISHING, _S.WAITING_ADMISSION}),
    _S.DECODE_READY: frozenset({_S.DECODE_RUNNING, _S.WAITING_ADMISSION}),
    _S.DECODE_RUNNING: frozenset({_S.DECODE_READY, _S.FINISHING, _S.WAITING_ADMISSION}),
    _S.FINISHING: frozenset({_S.COMPLETED}),
    _S.COMPLETED: frozenset(),
    _S.CANCELLED: frozenset(),
    _S.FAILED: frozenset(),
}
for _state in list(_LEGAL):
    if _state not in TERMINAL_STATES and _state is not _S.FINISHING:
        _LEGAL[_state] = _LEGAL[_state] | {_S.CANCELLED, _S.FAILED}


class IllegalTransition(AssertionError):
    """A state change the lifecycle does not allow: always a scheduler bug."""


LEGAL_MOVES = _LEGAL  # read-only: RequestRecord.move inlines the check on the hot path


def check_transition(old: RequestState, new: RequestState) -> None:
    if new not in _LEGAL[old]:
        raise IllegalTransition(f"{old.name} -> {new.name}")


@dataclass
class GenerateParams:
    """What a client asked for (wire fields of `op: generate`)."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[list[int]] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)  # matched on the output text (engine.core.text_stream)
    ignore_eos: bool = False
    deadline_ms: int | None = None  # relative to submission; None = the configured default
    tenant: str = "default"
    priority: int = 0  # orders requests *within* a tenant only; weights come from configuration
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per sampled token (engine.core.logprob_asks)
    prompt_logprobs: int | None = None  # the prompt's logprobs with this many alternatives; None: not asked
    # Tokens already produced for this request elsewhere (a balancer resuming a
    # broken stream): context after the prompt, counted toward max_tokens,
    # inside the stop-sequence window, never re-emitted.
    continuation: list[int] = field(default_factory=list)
    prefix_salt: str = ""
    speculative: str | None = None  # "off" | "ngram"; None: the board's speculative.method
    constraint: ConstraintSpec | None = None  # structured output, compiled by the daemon at admission
    penalties: PenaltySpec | None = None  # penalties, logit bias, min_p, min_tokens (None: all neutral)

    @property
    def host_stepped(self) -> bool:
        """Whether each token needs the worker's per-request state (a constraint matcher, penalty counts):
        then no queued next step (and, for a constraint, no multi-step decode; for penalties, no drafts)."""
        return self.constraint is not None or self.penalties is not None
    adapter: int = -1  # the board's number of the LoRA adapter the request runs under; -1 = the base model
