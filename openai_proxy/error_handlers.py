"""Every error is OpenAI's error JSON, never a traceback: the app's exception handlers."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dlm_protocol.errors import PREFIX_INVALID

from .errors import InternalError, InvalidRequest, ProxyError, error_body, param_of
from .schemas import KEY_OF_ALIAS

log = logging.getLogger("openai_proxy")


def error_response(err: ProxyError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status_code, headers=err.headers or None)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """First pydantic error as 'field: message', with the field as OpenAI's `param`."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "request body must be a JSON object (Content-Type: application/json)", None
    if first.get("type") == "missing" and not loc:
        return "request body is required", None
    if not loc and msg.startswith(PREFIX_INVALID):  # a body-level check naming its field
        return msg, param_of(msg)
    sent_as = ""
    if loc and loc[0] in KEY_OF_ALIAS:  # name the contract key, as the engine does
        sent_as = f" (sent as {loc[0]})"
        loc[0] = KEY_OF_ALIAS[loc[0]]
    param = ".".join(loc) if loc else None
    msg += sent_as
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


async def _proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
    return error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(exc)
    return error_response(InvalidRequest(message, param=param, code="invalid_value"))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = error_body(str(exc.detail), kind, code=str(exc.status_code))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s", request.url.path)
    return error_response(InternalError("internal error in the proxy; see its log"))


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ProxyError, _proxy_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
