"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with our protocol's status codes.

Every rejection the front makes, and every `error` event the upstream sends,
becomes one `OpenAIError`; the shell turns it into a JSON response (or a last
SSE event once a stream has started).
"""

from __future__ import annotations

import orjson

# Our protocol's codes -> OpenAI's error `type` strings.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 429: "rate_limit_error", 501: "not_implemented_error",
          503: "service_unavailable_error", 504: "timeout_error"}


class OpenAIError(Exception):
    """A request the front answers with an error: HTTP `status`, OpenAI `type`, the `param` at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return orjson.dumps(self.body())


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
    return OpenAIError(status, message, param=param, code=reason)
