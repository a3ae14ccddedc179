"""The proxy's OpenAPI schema: FastAPI's, less the 422 it documents for every route with a body
or parameters. The proxy answers validation errors with 400 and OpenAI's error body
(`error_handlers.py`); the routes document that 400 (`routers/_responses.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

# FastAPI's validation-error models, referenced only by the 422 answers dropped here.
_FASTAPI_422_SCHEMAS = ("HTTPValidationError", "ValidationError")


def without_422(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every operation's 422 answer and FastAPI's validation models removed."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            if isinstance(operation, dict):
                operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in _FASTAPI_422_SCHEMAS:
        components.pop(name, None)
    return schema


def openapi_of(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """A replacement for `app.openapi`: FastAPI's schema less the 422s, built once and cached."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = without_422(FastAPI.openapi(app))
        return app.openapi_schema

    return openapi
