"""Typed errors with stable message prefixes.

gRPC streams drop Triton error codes, so the prefix is the contract: the proxy maps
`invalid request:` to HTTP 400 and `overloaded:` to 429/503. The invalid-request error is the
request contract's own (`dlm_protocol`), so every layer raises and catches the same class.
"""

from __future__ import annotations

from dlm_protocol.errors import PREFIX_OVERLOADED, InvalidRequestError

__all__ = ["EngineOverloadedError", "InvalidRequestError"]


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the client may retry later."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{PREFIX_OVERLOADED} {message}")
