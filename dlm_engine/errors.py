"""Typed errors with stable message prefixes.

gRPC streams drop Triton error codes, so the prefix is the contract: the proxy maps
`invalid request:` to HTTP 400 and `overloaded:` to 429/503.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request parameter is wrong; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.reason = message
        super().__init__(f"invalid request: {field}: {message}")


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the client may retry later."""

    def __init__(self, message: str) -> None:
        super().__init__(f"overloaded: {message}")
