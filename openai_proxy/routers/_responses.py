"""OpenAPI documentation of the error answers a route may give (OpenAI's error body).

The proxy answers a request that fails validation with 400 and OpenAI's error JSON
(`error_handlers.py`), never FastAPI's 422: `openapi.py` drops the 422 FastAPI documents on its
own, and the routes document 400 here.
"""

from __future__ import annotations

from typing import Any

from ..schemas import ErrorResponse

_DESCRIPTIONS: dict[int, str] = {
    400: "Invalid request: a field failed validation (the error's `param` names it) or the "
    "body is not valid JSON",
    401: "Missing or invalid API key (only when keys are configured)",
    404: "No served model has this id",
    413: "Request body larger than the proxy's limit",
    503: "Overloaded, draining or no Triton ready (`Retry-After` says when to retry)",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route that may answer these error codes."""
    return {code: {"model": ErrorResponse, "description": _DESCRIPTIONS[code]} for code in codes}


# The generation routes (chat, completions).
ERROR_RESPONSES = error_responses(400, 401, 404, 413, 503)
