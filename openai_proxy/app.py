"""The FastAPI application: state, lifespan, middleware, error handlers and the routers.

`create_app(config)` builds a fresh app (tests start several with different settings). The
routes live in `routers/` (chat, completions, models, observability), each reaching the shared
`ProxyState` through FastAPI dependencies (`dependencies.py`); a generation call is run by
`generation.py`; Triton is behind `triton_backend.py` (pool and health: `triton_pool.py`; one
stream per job: `triton_stream.py`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from . import openapi, playground, security
from .config import ProxyConfig
from .dependencies import ProxyState
from .error_handlers import add_error_handlers, error_response
from .metrics import ProxyMetrics
from .middleware import ApiKeyGate, BodySizeLimit, RequestCounter
from .routers import ROUTERS

__all__ = ["ProxyMetrics", "ProxyState", "create_app", "error_response"]

log = logging.getLogger("openai_proxy")


def create_app(config: ProxyConfig | None = None) -> FastAPI:
    """Build the proxy app; Triton clients are created in the lifespan (inside the event loop)."""
    cfg = config or ProxyConfig()
    cfg.validate()
    state = ProxyState.build(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.backend.start()
        log.info("proxy ready; triton %s", ", ".join(cfg.triton_urls))
        try:
            yield
        finally:
            # New calls get 503; running ones may finish within the drain timeout.
            state.draining = True
            metrics = state.metrics
            if metrics.in_flight:
                log.info("draining %d in-flight requests", metrics.in_flight)
                if not await metrics.wait_idle(cfg.drain_timeout_s):
                    log.warning("drain timeout: %d requests still running", metrics.in_flight)
            await state.backend.close()

    app = FastAPI(
        title="dlm-triton OpenAI-compatible API",
        version="0.1.0",
        description="OpenAI chat and completions for diffusion language models (LLaDA, Dream) "
        "served by Triton. Diffusion fields (steps, block_length, algorithm, threshold, "
        "alg_temp, cfg_scale, stream_mode, max_nfe, ...) extend the OpenAI request bodies; "
        "usage reports forwards and tokens_per_forward.",
        lifespan=lifespan,
        # No browser UI (FastAPI's would load Swagger UI / ReDoc from a CDN onto this origin);
        # the schema is served by openapi.router, behind the API keys when there are some.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.proxy = state
    # Older names, kept for callers that read them.
    app.state.config = cfg
    app.state.backend = state.backend
    app.state.metrics = state.metrics

    add_error_handlers(app)
    # Added innermost first: CORS wraps the key gate and the size limit, so a browser reads
    # their 401 and 413 (and preflights need no key); the key gate answers before the body is
    # read or measured (a call without a valid key gets 401 whatever its body).
    app.add_middleware(BodySizeLimit, limit=cfg.max_request_bytes)
    app.add_middleware(ApiKeyGate, keys=state.api_keys)
    if cfg.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cfg.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    # /metrics on its own port, or behind the admin keys on the API port (security.py)
    app.add_middleware(security.MetricsGate, cfg=cfg, keys=state.api_keys, admins=state.admin_keys)
    app.add_middleware(RequestCounter, metrics=state.metrics)  # outermost: counts 413s too
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(openapi.router)
    if cfg.playground_enabled(has_keys=bool(state.api_keys)):
        app.include_router(playground.router)
    app.openapi = openapi.openapi_of(app)  # type: ignore[method-assign]  # 400, not FastAPI's 422
    # for openai_proxy.drain: 503 `draining` to new calls while the listener stays open
    app.state.begin_drain = lambda: setattr(state, "draining", True)
    app.state.in_flight = lambda: state.metrics.in_flight
    return app
