"""Client-side exceptions: one class per server error code.

The server answers every failure with an `error` event carrying an HTTP-like
`code`; callers branch on the exception type (retry on `Overloaded`, give up
on `InvalidRequest`) instead of parsing messages.
"""

from __future__ import annotations


class ClientError(Exception):
    """A request failed; `code`/`reason`/`retryable`/`retry_after_ms` come from the server's error event.

    `retry_after_ms` (a retryable 429/503): the server's estimate of when a retry may succeed; None when it
    gave none.
    """

    code: int = 0

    def __init__(self, message: str = "", *, code: int | None = None, reason: str = "",
                 retryable: bool = False, id: str | None = None, details: dict | None = None,
                 retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.details = dict(details or {})  # extra fields of the error event (e.g. `step` of a refused load)
        if code is not None:
            self.code = code
        self.reason = reason
        self.message = message
        self.retryable = retryable
        self.retry_after_ms = retry_after_ms
        self.id = id

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}" if self.reason else f"{self.code}: {self.message}"


class InvalidRequest(ClientError):
    code = 400


class Unauthorized(ClientError):
    code = 401


class Forbidden(Unauthorized):
    code = 403


class ModelNotFound(ClientError):
    code = 404


class Overloaded(ClientError):
    code = 429


class ServerError(ClientError):
    code = 500


class NotSupported(ClientError):
    """The server does not implement this operation (501)."""

    code = 501


class Unavailable(ClientError):
    code = 503


class DeadlineExceeded(ClientError):
    code = 504


class ClientTimeout(ClientError, TimeoutError):
    """No answer within the call's timeout (client-side; the request was cancelled)."""

    code = 0


# Keyed by each class's own `code`, so a code is written in one place only.
_BY_CODE: dict[int, type[ClientError]] = {
    cls.code: cls
    for cls in (InvalidRequest, Unauthorized, Forbidden, ModelNotFound, Overloaded, ServerError,
                NotSupported, Unavailable, DeadlineExceeded)
}


def error_from_event(event: dict) -> ClientError:
    """Map a server `error` event to its exception (unknown codes by class: 4xx invalid, 5xx server)."""
    code = int(event.get("code") or 500)
    cls = _BY_CODE.get(code)
    if cls is None:
        cls = InvalidRequest if 400 <= code < 500 else ServerError
    details = {k: v for k, v in event.items() if k not in _EVENT_KEYS}
    retry_after = event.get("retry_after_ms")
    return cls(str(event.get("message", "")), code=code, reason=str(event.get("reason", "")),
               retryable=bool(event.get("retryable", False)), id=event.get("id"), details=details,
               retry_after_ms=retry_after if type(retry_after) is int and retry_after >= 0 else None)


_EVENT_KEYS = frozenset({"v", "ev", "id", "code", "reason", "message", "retryable", "retry_after_ms"})
