"""The Triton servers behind the proxy: gRPC aio clients, health probes and server choice.

Channels are created inside the running event loop (grpc.aio binds them to it). A health loop
probes every URL for readiness and its repository index, so requests go only to servers that
serve their model, and a restarted tritonserver is found again within about a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from .admin_key import model_states
from .config import ProxyConfig
from .errors import ModelNotFound, ServiceUnavailable

log = logging.getLogger("openai_proxy.triton")

# Short reconnect backoff so a restarted tritonserver is found again within about a second.
_CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 20000),
    ("grpc.keepalive_timeout_ms", 10000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass
class BackendState:
    """What the last probe of one Triton URL found."""

    url: str
    client: InferenceServerClient
    ready: bool = False
    models: set[str] = field(default_factory=set)
    # Every model in the repository index with its state (READY, LOADING, UNAVAILABLE, ...).
    states: dict[str, str] = field(default_factory=dict)
    last_error: str = ""
    last_probe: float = 0.0
    in_flight: int = 0


class TritonPool:
    """A pool of tritonservers serving the same models: one gRPC aio client each, a health
    loop probing readiness and the model index, and the choice of a server for a request
    (least in flight, round-robin among equals)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._states: list[BackendState] = []
        self._rr = 0
        self._health_task: asyncio.Task[None] | None = None
        self._probe_lock = asyncio.Lock()
        self._last_refresh = 0.0
        # model name -> max_batch_size (> 0 means tensors carry a leading batch dim).
        self._batch_dims: dict[str, int] = {}

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create channels inside the running loop (grpc.aio binds them to it) and probe once."""
        self._states = [
            BackendState(url=u, client=InferenceServerClient(u, channel_args=_CHANNEL_ARGS))
            for u in self.config.triton_urls
        ]
        await self.refresh(force=True)
        self._health_task = asyncio.create_task(self._health_loop(), name="triton-health")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        for st in self._states:
            with contextlib.suppress(Exception):
                await st.client.close()

    # -- health ---------------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.refresh(force=True)
            except Exception:  # never let the loop die
                log.exception("health probe failed")

    async def _probe(self, st: BackendState) -> None:
        timeout = self.config.health_timeout_s
        was_ready = st.ready
        try:
            ready = await st.client.is_server_ready(client_timeout=timeout)
            states: dict[str, str] = {}
            if ready:
                states = await model_states(st.client, self.config, timeout)
            models = {name for name, state in states.items() if state == "READY"}
            st.ready, st.models, st.states, st.last_error = bool(ready), models, states, ""
        except Exception as exc:  # any failure = not ready; the message is kept for /health
            st.ready, st.models, st.states = False, set(), {}
            st.last_error = _short(exc)
        st.last_probe = time.monotonic()
        if was_ready != st.ready:
            log.warning(
                "triton %s is now %s%s",
                st.url,
                "ready" if st.ready else "NOT ready",
                f" ({st.last_error})" if st.last_error else "",
            )

    async def refresh(self, force: bool = False) -> None:
        """Probe all URLs; concurrent callers share one probe, and unforced ones are rate-limited."""
        async with self._probe_lock:
            if not force and time.monotonic() - self._last_refresh < 0.25:
                return
            await asyncio.gather(*(self._probe(st) for st in self._states))
            self._last_refresh = time.monotonic()

    def ready_models(self) -> list[str]:
        names: set[str] = set()
        for st in self._states:
            if st.ready:
                names |= st.models
        return sorted(names)

    def any_ready(self) -> bool:
        return any(st.ready for st in self._states)

    def health(self) -> list[dict[str, Any]]:
        return [
            {
                "url": st.url,
                "ready": st.ready,
                "models": sorted(st.models),
                "in_flight": st.in_flight,
                **({"error": st.last_error} if st.last_error else {}),
            }
            for st in self._states
        ]

    async def check_model(self, model: str) -> None:
        """404 for a model no ready Triton serves, 503 when no Triton is ready at all."""
        if self._candidates(model):
            return
        await self.refresh()
        if self._candidates(model):
            return
        if not self.any_ready():
            raise self.unavailable()
        if any(st.states.get(model) == "LOADING" for st in self._states):
            # Being loaded: worth retrying soon (an unloaded or failed model is a 404).
            raise ServiceUnavailable(
                f"model '{model}' is still loading in Triton",
                self.config.retry_after_s,
                code="model_not_ready",
            )
        raise ModelNotFound(model)

    def _candidates(self, model: str) -> list[BackendState]:
        return [st for st in self._states if st.ready and model in st.models]

    def unavailable(self) -> ServiceUnavailable:
        errors = "; ".join(f"{st.url}: {st.last_error or 'not ready'}" for st in self._states)
        return ServiceUnavailable(
            f"Triton is not ready ({errors})", self.config.retry_after_s, code="triton_unavailable"
        )

    def pick(self, model: str, exclude: set[str]) -> BackendState | None:
        cands = [st for st in self._candidates(model) if st.url not in exclude]
        if not cands:
            return None
        self._rr = (self._rr + 1) % (1 << 30)
        # Least in-flight first, round-robin among equals.
        low = min(st.in_flight for st in cands)
        ties = [st for st in cands if st.in_flight == low]
        return ties[self._rr % len(ties)]

    async def model_config(self, model: str) -> dict[str, Any]:
        """The model's Triton config (JSON form) from a ready server that serves it."""
        await self.check_model(model)
        st = self._candidates(model)[0]
        cfg = await st.client.get_model_config(
            model, as_json=True, client_timeout=self.config.health_timeout_s
        )
        return cfg.get("config", cfg)

    async def batch_dim(self, st: BackendState, model: str) -> int:
        if model not in self._batch_dims:
            cfg = await st.client.get_model_config(
                model, as_json=True, client_timeout=self.config.health_timeout_s
            )
            self._batch_dims[model] = int(cfg.get("config", cfg).get("max_batch_size", 0) or 0)
        return self._batch_dims[model]


def _short(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, InferenceServerException):
        return exc.message() or str(exc)
    return str(exc) or type(exc).__name__
