"""What routes depend on: the proxy's shared state, API-key auth and the draining guard.

The state lives on `app.state.proxy` (one per app, so tests can build several apps); routes
reach it through `Depends(get_state)` instead of closures over `create_app`'s locals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from . import security
from .config import ProxyConfig
from .errors import ServiceUnavailable
from .metrics import ProxyMetrics
from .triton_backend import TritonBackend


@dataclass
class ProxyState:
    """Everything one app instance shares between requests."""

    config: ProxyConfig
    backend: TritonBackend
    metrics: ProxyMetrics
    draining: bool = False
    api_keys: list[bytes] = field(default_factory=list)
    admin_keys: list[bytes] = field(default_factory=list)  # operators: /metrics, /health details

    @classmethod
    def build(cls, config: ProxyConfig) -> ProxyState:
        return cls(
            config=config,
            backend=TritonBackend(config),
            metrics=ProxyMetrics(),
            api_keys=security.api_keys(config),  # flags, env and the key file
            admin_keys=security.admin_keys(config),
        )


# Dependencies are `async def` though they never wait: FastAPI runs a plain `def` dependency in
# its thread pool, two thread hand-offs per call for an attribute read and a flag check.
async def get_state(request: Request) -> ProxyState:
    return request.app.state.proxy


# A route or dependency parameter `state: State` receives the app's ProxyState.
State = Annotated[ProxyState, Depends(get_state)]


async def require_api_key(request: Request, state: State) -> None:
    """Bearer auth, only when keys are configured (constant-time compare). The API routes are
    also gated before their body is read (`middleware.ApiKeyGate`): this is the same check."""
    error = security.api_key_error(request.headers, state.api_keys)
    if error is not None:
        raise error


async def tenant_key(request: Request, state: State) -> bytes | None:
    """The caller's API key when the prefix cache is kept per key (`tenancy.py`); None with
    no keys configured or the cache shared on purpose (`--share-prefix-cache`)."""
    if not state.api_keys or state.config.share_prefix_cache:
        return None
    return security.matching_key(request.headers, state.api_keys)


# A generation route's parameter `tenant: TenantKey` receives the key its jobs are salted with.
TenantKey = Annotated[bytes | None, Depends(tenant_key)]


async def not_draining(state: State) -> None:
    """New generation calls get 503 once shutdown began (running ones may finish)."""
    if state.draining:
        cfg = state.config
        raise ServiceUnavailable("proxy is shutting down", cfg.retry_after_s, code="draining")
