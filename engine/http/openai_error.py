"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with our protocol's status codes.

Every rejection the front makes, and every `error` event the upstream sends,
becomes one `OpenAIError`; the shell turns it into a JSON response (or a last
SSE event once a stream has started). A retryable 429/503 keeps the upstream's
`retry_after_ms`, which the response carries as a `Retry-After` header.
"""

from __future__ import annotations

import orjson

from engine.core.retry_after import header_seconds

# Our protocol's codes -> OpenAI's error `type` strings.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 429: "rate_limit_error", 501: "not_implemented_error",
          503: "service_unavailable_error", 504: "timeout_error"}


class OpenAIError(Exception):
    """A request the front answers with an error: HTTP `status`, OpenAI `type`, the `param` at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_ms = retry_after_ms  # when to come back (429/503): the `Retry-After` header
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return orjson.dumps(self.body())

    def headers(self) -> dict[str, str] | None:
        """The response headers this error needs: `Retry-After` (whole seconds, rounded up) on a 429/503 that
        says when to come back, `WWW-Authenticate` on a 401."""
        if self.status == 401:
            return {"www-authenticate": "Bearer"}
        if self.status in (429, 503) and self.retry_after_ms is not None:
            return {"retry-after": str(header_seconds(self.retry_after_ms))}
        return None


def bad(param: str | None, message: str, code: str = "invalid_value") -> OpenAIError:
    """A 400 naming the body field at fault."""
    return OpenAIError(400, f"{param}: {message}" if param else message, param=param, code=code)


def from_upstream(ev: dict) -> OpenAIError:
    """An upstream `error` event (code, reason, message) as an OpenAIError with the same status."""
    code = int(ev.get("code") or 500)
    status = code if 400 <= code <= 599 else 500
    reason = str(ev.get("reason") or "") or None
    message = str(ev.get("message") or reason or "upstream error")
    param = message.split(":", 1)[0] if status == 400 and ":" in message and " " not in message.split(":", 1)[0] \
        else None
    retry_after = ev.get("retry_after_ms")
    return OpenAIError(status, message, param=param, code=reason,
                       retry_after_ms=retry_after if type(retry_after) is int and retry_after >= 0 else None)
