"""OpenAPI documentation of the error answers a route may give."""

from __future__ import annotations

from typing import Any

from ..schemas import ErrorResponse

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)
}
