"""The one error a bad request value raises, and the message prefixes every layer shares.

gRPC streams drop Triton's error codes, so the prefix of the message is the contract: the proxy
maps `invalid request:` to HTTP 400, `overloaded:` to 503 and `internal error:` to 500.
"""

from __future__ import annotations

PREFIX_INVALID = "invalid request:"
PREFIX_OVERLOADED = "overloaded:"
PREFIX_INTERNAL = "internal error:"
ERROR_PREFIXES = (PREFIX_INVALID, PREFIX_OVERLOADED, PREFIX_INTERNAL)


class InvalidRequestError(ValueError):
    """A request value is wrong; `field` names it (the canonical key, never an alias).

    `str()` is the message every surface shows: ``invalid request: <field>: <reason>``.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.reason = message
        super().__init__(f"{PREFIX_INVALID} {field}: {message}")
