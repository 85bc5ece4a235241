"""What the balancer core asks its shell to do (besides the client-side actions it shares with the scheduler).

Client-side actions are the scheduler core's own `EmitTokens`, `FinishRequest`
and `FailRequest` (so the daemon's `Frontend` carries them out unchanged);
these are the upstream side and the one-reply ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.actions import EmitTokens, FailRequest, FinishRequest

__all__ = ["EmitTokens", "FailRequest", "FinishRequest", "SendUpstream", "Reply", "ReplyError", "CloseBackend",
           "OpenBackend"]


@dataclass
class SendUpstream:
    """Send `msg` to backend `backend`; a failed send is reported back with `core.on_send_failed`."""

    backend: str
    msg: dict


@dataclass
class Reply:
    """Answer a one-reply op (health/stats/models/drain/resume); `token` is the shell's opaque handle."""

    token: Any
    ev: str
    body: dict


@dataclass
class ReplyError:
    token: Any
    code: int
    reason: str
    message: str
    retryable: bool = False


@dataclass
class OpenBackend:
    """Connect a socket to a (new) backend endpoint."""

    backend: str


@dataclass
class CloseBackend:
    """A removed backend has no request left: close its socket."""

    backend: str
