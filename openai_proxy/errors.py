"""OpenAI-shaped errors and the mapping from Triton's messages to HTTP statuses.

Triton loses error codes on gRPC streams (only the message arrives), so the model prefixes its
messages (`invalid request: `, `overloaded: `, `internal error: `) and we map on the prefix.
"""

from __future__ import annotations

from typing import Any

# The message prefixes are the request contract's (one source for model, adapter and proxy).
from dlm_protocol.errors import PREFIX_INTERNAL, PREFIX_INVALID, PREFIX_OVERLOADED

# Substrings of gRPC / Triton messages that mean the server could not be reached or is going away.
_UNAVAILABLE_MARKERS = (
    "statuscode.unavailable",
    "failed to connect",
    "connection refused",
    "socket closed",
    "connect failed",
    "server is not ready",
    "server is shutting down",
    "server not ready",
    "no healthy",
    "broken pipe",
    "is not healthy",  # Triton: "Stub process '<model>_0_0' is not healthy" (being restarted)
)
_NOT_FOUND_MARKERS = ("unknown model", "is not found", "no model named")
_TIMEOUT_MARKERS = ("deadline exceeded", "deadline_exceeded", "statuscode.deadline_exceeded")


class ProxyError(Exception):
    """An error that is answered in OpenAI's error JSON with a fixed HTTP status."""

    status_code: int = 500
    error_type: str = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status_code: int | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status_code is not None:
            self.status_code = status_code
        if error_type is not None:
            self.error_type = error_type
        self.headers = dict(headers or {})

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class InvalidRequest(ProxyError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(ProxyError):
    status_code = 401
    error_type = "authentication_error"

    def __init__(self, message: str = "invalid or missing API key") -> None:
        super().__init__(message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class ModelNotFound(ProxyError):
    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model '{model}' does not exist or is not ready; see GET /v1/models",
            param="model",
            code="model_not_found",
        )


class RequestTooLarge(ProxyError):
    status_code = 413
    error_type = "invalid_request_error"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds the limit of {limit} bytes", code="body_too_large")


class ServiceUnavailable(ProxyError):
    """Triton is down, not ready, overloaded or draining: the client should retry later."""

    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, retry_after_s: int = 2, code: str = "unavailable") -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after_s)})


class UpstreamTimeout(ProxyError):
    status_code = 504
    error_type = "timeout"


class InternalError(ProxyError):
    status_code = 500
    error_type = "server_error"


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def param_of(message: str) -> str | None:
    """`invalid request: steps: must be >= 1` names the field after the prefix."""
    rest = message.split(":", 1)[1].strip() if ":" in message else ""
    head, sep, _ = rest.partition(":")
    if sep and head and " " not in head.strip() and len(head) < 64:
        return head.strip()
    return None


def from_triton_message(message: str, retry_after_s: int = 2) -> ProxyError:
    """Map a Triton / gRPC error message to the ProxyError the client should see."""
    text = (message or "").strip()
    # Triton sometimes wraps the model's message ("[StatusCode.INTERNAL] invalid request: ...").
    lowered = text.lower()
    for prefix, build in (
        (PREFIX_INVALID, "invalid"),
        (PREFIX_OVERLOADED, "overloaded"),
        (PREFIX_INTERNAL, "internal"),
    ):
        idx = lowered.find(prefix)
        if idx < 0:
            continue
        core = text[idx:]
        if build == "invalid":
            return InvalidRequest(core, param=param_of(core), code="invalid_value")
        if build == "overloaded":
            return ServiceUnavailable(core, retry_after_s, code="overloaded")
        return InternalError(core, code="model_error")
    if any(m in lowered for m in _TIMEOUT_MARKERS):
        return UpstreamTimeout("Triton did not answer in time: " + text, code="timeout")
    if any(m in lowered for m in _UNAVAILABLE_MARKERS):
        return ServiceUnavailable("Triton is unavailable: " + text, retry_after_s)
    if any(m in lowered for m in _NOT_FOUND_MARKERS):
        return ProxyError(
            text, status_code=404, error_type="invalid_request_error", code="model_not_found"
        )
    return InternalError("Triton error: " + text if text else "Triton error", code="upstream_error")
