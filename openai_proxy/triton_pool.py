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
from typing import Any

import grpc
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from .admin_key import model_states
from .config import ProxyConfig
from .errors import ModelNotFound, ServiceUnavailable
from .replicas import Replica, ReplicaPool

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


# One replica: its client, what the last probe found, and its counters (replicas.py).
BackendState = Replica[InferenceServerClient]

# How long a model's admission limit (`queue_capacity`) is kept before its config is read again.
CAPACITY_TTL_S = 5.0


def server_capacity(triton_config: dict[str, Any]) -> int | None:
    """Requests one tritonserver admits for a model at once: its `max_queue` parameter (each
    instance refuses `overloaded:` beyond it, dlm_triton/backend/triton_model.py) x its instances
    (an `instance_group` entry counts once per listed GPU). None: the config has no max_queue."""
    raw = triton_config.get("parameters", {}).get("max_queue", {}).get("string_value", "")
    try:
        max_queue = int(raw)
    except ValueError:
        return None
    if max_queue < 1:
        return None
    instances = sum(
        int(group.get("count", 1) or 1) * max(len(group.get("gpus") or []), 1)
        for group in triton_config.get("instance_group") or [{}]
    )
    return max_queue * max(instances, 1)


class TritonPool:
    """The tritonservers serving the same models: one gRPC aio client each (membership, choice,
    ejection and per-replica counters: `replicas.ReplicaPool`), and a health loop probing
    readiness and the model index, re-resolving `dns:` entries every `resolve_interval_s`."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.pool: ReplicaPool[InferenceServerClient] = ReplicaPool(
            config.triton_urls,
            lambda url: InferenceServerClient(url, channel_args=_CHANNEL_ARGS),
            lambda client: client.close(),
            eject_s=config.health_interval_s,
        )
        self._last_sync = 0.0
        self._health_task: asyncio.Task[None] | None = None
        self._probe_lock = asyncio.Lock()
        self._last_refresh = 0.0
        # model name -> max_batch_size (> 0 means tensors carry a leading batch dim).
        self._batch_dims: dict[str, int] = {}
        # model name -> (monotonic time read, one server's capacity or None): `queue_capacity`.
        self._capacities: dict[str, tuple[float, int | None]] = {}

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create channels inside the running loop (grpc.aio binds them to it) and probe once."""
        await self.pool.sync()
        self._last_sync = time.monotonic()
        await self.refresh(force=True)
        self._health_task = asyncio.create_task(self._health_loop(), name="triton-health")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.pool.close()

    @property
    def _states(self) -> list[BackendState]:
        return self.pool.replicas

    # -- health ---------------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                if time.monotonic() - self._last_sync >= self.config.resolve_interval_s:
                    self._last_sync = time.monotonic()
                    await self.pool.sync()
                await self.refresh(force=True)
            except Exception:  # never let the loop die
                log.exception("health probe failed")

    async def _probe(self, st: BackendState) -> None:
        timeout = self.config.health_timeout_s
        try:
            ready = await st.client.is_server_ready(client_timeout=timeout)
            states: dict[str, str] = {}
            if ready:
                states = await model_states(st.client, self.config, timeout)
            self.pool.probed(st, bool(ready), states)
        except Exception as exc:  # any failure = not ready; the message is kept for /health
            self.pool.probed(st, False, {}, _short(exc))

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
                **({"draining": True} if st.draining else {}),
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
        if not self.any_ready() or any(model in st.models for st in self._states):
            raise self.unavailable()  # served, but no replica can take it now
        if any(st.states.get(model) == "LOADING" for st in self._states):
            # Being loaded: worth retrying soon (an unloaded or failed model is a 404).
            raise ServiceUnavailable(
                f"model '{model}' is still loading in Triton",
                self.config.retry_after_s,
                code="model_not_ready",
            )
        raise ModelNotFound(model)

    def _candidates(self, model: str) -> list[BackendState]:
        return self.pool.candidates(model)

    def unavailable(self) -> ServiceUnavailable:
        errors = "; ".join(f"{st.url}: {self.pool.why_not_usable(st)}" for st in self._states)
        return ServiceUnavailable(
            f"Triton is not ready ({errors})", self.config.retry_after_s, code="triton_unavailable"
        )

    def pick(self, model: str, exclude: set[str]) -> BackendState | None:
        """The usable replica serving `model` with the fewest requests open (ties rotate)."""
        return self.pool.pick(model, exclude)

    async def model_config(self, model: str) -> dict[str, Any]:
        """The model's Triton config (JSON form) from a ready server that serves it."""
        await self.check_model(model)
        st = self._candidates(model)[0]
        cfg = await st.client.get_model_config(
            model, as_json=True, client_timeout=self.config.health_timeout_s
        )
        return cfg.get("config", cfg)

    async def queue_capacity(self, model: str) -> int | None:
        """Requests the tritonservers of `model` admit at once: `server_capacity` of its config x
        the replicas that serve it or may come back (not ready now). A call fanning out to more
        can never run; None when unknown (no check). The config is read again after
        `CAPACITY_TTL_S`, so a server restarted with another `max_queue` is seen."""
        now = time.monotonic()
        cached = self._capacities.get(model)
        if cached is None or now - cached[0] >= CAPACITY_TTL_S:
            try:
                cached = (now, server_capacity(await self.model_config(model)))
            except Exception:  # not known now: the call goes ahead as before
                cached = (now, None)
            self._capacities[model] = cached
        per_server = cached[1]
        if per_server is None:
            return None
        servers = sum(1 for st in self._states if not st.ready or model in st.states)
        return per_server * max(servers, 1)

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
