"""What the scheduler core asks its I/O shell to do.

The core never performs I/O; every call returns a list of these, in the order
the shell must carry them out (tokens of a request before its terminal event).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ipc.records import Job


@dataclass
class SubmitJob:
    chip: int
    job: Job
    request_ids: list[int] = field(default_factory=list)  # lane order; for traces, never for metric labels


class EmitTokens(NamedTuple):
    """A NamedTuple, not a dataclass: one is made per generated token (half the cost)."""

    request_id: int
    tokens: list[int]  # may be empty when `text` releases held text at the end
    logprobs: list[float] | None = None
    text: str | None = None  # decoded delta (None: the scheduler has no tokenizer)
    top_logprobs: list | None = None  # per token, its alternatives [[id, logprob], ...] (when asked)
    prompt_logprobs: dict | None = None  # the prompt's logprobs, once, before the first token (when asked)


@dataclass
class FinishRequest:
    request_id: int
    finish_reason: str  # "length" | "eos" | "stop" | "cancelled"
    usage: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens, cached_tokens
    timing: dict = field(default_factory=dict)  # ttft_ms, tpot_ms, e2e_ms, queue_ms


@dataclass
class FailRequest:
    request_id: int
    code: int
    reason: str
    message: str
    retryable: bool
    timing: dict | None = None  # as FinishRequest's, when the request was accepted (None: rejected at submit)
    retry_after_ms: int | None = None  # a retryable 429/503: when to come back (engine/core/retry_after.py)


@dataclass
class ReleaseBlocks:
    """These KV blocks of `chip` hold nothing the scheduler will read again (freed, not prefix-cached).

    Sent before any job that reuses one of them. A backend whose KV lives in
    the blocks themselves ignores it; one with its own KV store (llama.cpp's
    cells) frees what it keeps for them.
    """

    chip: int
    blocks: list[int]


Action = SubmitJob | EmitTokens | FinishRequest | FailRequest | ReleaseBlocks
