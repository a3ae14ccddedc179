"""Health and metrics: open to probes (no API key); what they reveal is `security.py`'s call
(/health's details for operators only, /metrics on its own port or behind the admin keys)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from .. import security
from ..dependencies import State

router = APIRouter()


@router.get("/health", summary="Proxy and Triton readiness (503 while no Triton is ready)")
async def health(request: Request, state: State) -> Any:
    backend = state.backend
    if not backend.any_ready():
        await backend.refresh()
    ready = backend.any_ready() and not state.draining
    body = {
        "status": "ok" if ready else ("draining" if state.draining else "unavailable"),
        "triton": backend.health(),
        "models": backend.ready_models(),
        "in_flight": state.metrics.in_flight,
    }
    if not security.sees_internals(request.headers, state.config, state.api_keys, state.admin_keys):
        body = security.public_health(body)  # probes and tenants learn the status only
    if ready:
        return body
    headers = {"Retry-After": str(state.config.retry_after_s)}
    return JSONResponse(body, status_code=503, headers=headers)


@router.get("/health/live", summary="The proxy process answers (no Triton check)")
async def live() -> Any:
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse, summary="Proxy metrics (Prometheus)")
async def prom_metrics(state: State) -> Any:
    return PlainTextResponse(
        state.metrics.render(state.backend, state.config.triton_metrics_url),
        media_type="text/plain; version=0.0.4",
    )
