"""The proxy's OpenAPI schema: FastAPI's, less the 422 it documents for every route with a body
or parameters. The proxy answers validation errors with 400 and OpenAI's error body
(`error_handlers.py`); the routes document that 400 (`routers/_responses.py`).

Only the JSON is served, at `/openapi.json`, and with API keys only to key holders, like
`/v1/`. FastAPI's browser pages (`/docs`, `/redoc`) are off: they load Swagger UI and ReDoc
from a CDN into pages of the API's own origin, where a changed script could read the keys a
user types. Any OpenAPI viewer reads the JSON instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from .dependencies import require_api_key

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


router = APIRouter()


@router.get("/openapi.json", include_in_schema=False, dependencies=[Depends(require_api_key)])
async def openapi_json(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())
