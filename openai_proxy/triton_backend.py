"""Triton behind the proxy: gRPC aio clients, health, round-robin and one stream per request.

Why a stream even for non-streaming calls: the served models are decoupled, and a gRPC stream
is the one Triton path where a client cancel reaches the model (the row leaves the batch), and
where TRITON_NOTES found cancellations clean at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferInput, InferResult
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from .admin_key import model_states
from .config import ProxyConfig
from .converters import TritonEvent, TritonJob
from .errors import (
    ModelNotFound,
    ProxyError,
    ServiceUnavailable,
    UpstreamTimeout,
    from_triton_message,
)
from .idle import idle_timeout

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


class TritonBackend:
    """A pool of tritonservers serving the same models; requests go round-robin to ready ones."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._states: list[BackendState] = []
        self._rr = 0
        self._health_task: asyncio.Task[None] | None = None
        self._probe_lock = asyncio.Lock()
        self._last_refresh = 0.0
        # model name -> max_batch_size (> 0 means tensors carry a leading batch dim).
        self._batch_dims: dict[str, int] = {}
        self.streams_opened = 0
        self.streams_cancelled = 0
        self.stream_errors = 0

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
            raise self._unavailable()
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

    def _unavailable(self) -> ServiceUnavailable:
        errors = "; ".join(f"{st.url}: {st.last_error or 'not ready'}" for st in self._states)
        return ServiceUnavailable(
            f"Triton is not ready ({errors})", self.config.retry_after_s, code="triton_unavailable"
        )

    def _pick(self, model: str, exclude: set[str]) -> BackendState | None:
        cands = [st for st in self._candidates(model) if st.url not in exclude]
        if not cands:
            return None
        self._rr = (self._rr + 1) % (1 << 30)
        # Least in-flight first, round-robin among equals.
        low = min(st.in_flight for st in cands)
        ties = [st for st in cands if st.in_flight == low]
        return ties[self._rr % len(ties)]

    # -- inference ------------------------------------------------------------------------------

    async def _batch_dim(self, st: BackendState, model: str) -> int:
        if model not in self._batch_dims:
            cfg = await st.client.get_model_config(
                model, as_json=True, client_timeout=self.config.health_timeout_s
            )
            self._batch_dims[model] = int(cfg.get("config", cfg).get("max_batch_size", 0) or 0)
        return self._batch_dims[model]

    def _inputs(self, job: TritonJob, batched: bool) -> list[InferInput]:
        lead = [1] if batched else []

        def text(name: str, value: str) -> InferInput:
            inp = InferInput(name, [*lead, 1], "BYTES")
            inp.set_data_from_numpy(
                np.array([value.encode("utf-8")], dtype=np.object_).reshape([*lead, 1])
            )
            return inp

        inputs: list[InferInput] = []
        if job.prompt_input == "input_ids":
            ids = np.asarray(job.prompt_value, dtype=np.int64).reshape([*lead, -1])
            inp = InferInput("input_ids", list(ids.shape), "INT64")
            inp.set_data_from_numpy(ids)
            inputs.append(inp)
        else:
            inputs.append(text(job.prompt_input, str(job.prompt_value)))
        flag = InferInput("stream", [*lead, 1], "BOOL")
        flag.set_data_from_numpy(np.array([job.stream], dtype=bool).reshape([*lead, 1]))
        inputs.append(flag)
        inputs.append(text("sampling_parameters", json.dumps(job.sampling_parameters)))
        return inputs

    async def generate(self, model: str, job: TritonJob) -> AsyncIterator[TritonEvent]:
        """One Triton stream for one job. Closing the generator cancels the stream at once."""
        tried: set[str] = set()
        while True:
            st = self._pick(model, tried)
            if st is None:
                if not tried:
                    await self.check_model(model)  # raises 404 / 503 with the right message
                    st = self._pick(model, tried)
                if st is None:
                    raise self._unavailable()
            tried.add(st.url)
            got_any = False
            try:
                async for event in self._stream(st, model, job):
                    got_any = True
                    yield event
                return
            except ServiceUnavailable as err:
                # Nothing received yet and this server is gone or full: another URL may serve it.
                if err.code == "triton_unavailable":
                    st.ready = False
                if got_any or len(tried) >= len(self._states):
                    raise

    async def _stream(
        self, st: BackendState, model: str, job: TritonJob
    ) -> AsyncIterator[TritonEvent]:
        try:
            batched = await self._batch_dim(st, model) > 0
        except Exception as exc:
            raise _map_exception(exc, self.config.retry_after_s) from None
        finished = asyncio.Event()
        request = {
            "model_name": model,
            "inputs": self._inputs(job, batched),
            "request_id": job.request_id,
        }

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield request
            # Keep our half of the stream open until the final response: some servers end a
            # stream as soon as the client half-closes.
            await finished.wait()

        call = st.client.stream_infer(requests(), stream_timeout=self.config.request_timeout_s)
        st.in_flight += 1
        self.streams_opened += 1
        complete = False
        try:
            idle_s = self.config.stream_idle_timeout_s
            async for result, error in idle_timeout(call, idle_s, lambda: _idle_error(idle_s)):
                if error is not None:
                    self.stream_errors += 1
                    raise from_triton_message(error.message(), self.config.retry_after_s)
                event = decode_result(result)
                if event.finish_reason:
                    event.final = True
                yield event
                if event.final:
                    complete = True
                    return
            raise ServiceUnavailable(
                "Triton closed the stream before the final response", self.config.retry_after_s
            )
        except ProxyError:
            raise
        except Exception as exc:
            self.stream_errors += 1
            raise _map_exception(exc, self.config.retry_after_s) from None
        finally:
            st.in_flight -= 1
            finished.set()
            if not complete:
                # Client gone, error or shutdown: tell Triton now so the row leaves the batch.
                self.streams_cancelled += 1
                call.cancel()


class FanIn:
    """Runs a call's jobs (n choices x prompts) concurrently and merges their events.

    Tasks start at construction. `cancel()` is synchronous on purpose: it must work from
    `finally` blocks that run inside an already-cancelled scope (client disconnects).
    """

    def __init__(self, backend: TritonBackend, model: str, jobs: list[TritonJob]) -> None:
        self._items: deque[tuple[TritonJob, TritonEvent | None, BaseException | None]] = deque()
        self._wake = asyncio.Event()
        self._remaining = len(jobs)
        self._backend = backend
        self._model = model
        self._tasks = [asyncio.create_task(self._worker(j), name=j.request_id) for j in jobs]

    async def _worker(self, job: TritonJob) -> None:
        try:
            async for event in self._backend.generate(self._model, job):
                self._push((job, event, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._push((job, None, exc))
        finally:
            self._push((job, None, None))

    def _push(self, item: tuple[TritonJob, TritonEvent | None, BaseException | None]) -> None:
        self._items.append(item)
        self._wake.set()

    async def raise_early_error(self, timeout: float) -> None:
        """Wait up to `timeout` for the first event; raise now if it is an error.

        Lets a streaming call answer a real HTTP 400/503 for errors Triton reports at once,
        before the SSE headers are sent.
        """
        if not self._items and timeout > 0:
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
        for _, _, exc in self._items:
            if exc is not None:
                self.cancel()
                raise exc

    def __aiter__(self) -> FanIn:
        return self

    async def __anext__(self) -> tuple[TritonJob, TritonEvent]:
        while True:
            while not self._items:
                if self._remaining == 0:
                    raise StopAsyncIteration
                self._wake.clear()
                await self._wake.wait()
            job, event, exc = self._items.popleft()
            if exc is not None:
                self.cancel()
                raise exc
            if event is None:
                self._remaining -= 1
                continue
            return job, event

    def cancel(self) -> None:
        for t in self._tasks:
            if not t.done():
                t.cancel()


def _as_str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return "" if value is None else str(value)


def _first(result: InferResult, name: str) -> Any:
    arr = result.as_numpy(name)
    if arr is None or arr.size == 0:
        return None
    return arr.reshape(-1)[0]


def decode_result(result: InferResult) -> TritonEvent:
    """Decode the outputs of one Triton response (missing outputs read as empty)."""
    canvas_raw = _as_str(_first(result, "canvas"))
    canvas = json.loads(canvas_raw) if canvas_raw else None
    reason = _as_str(_first(result, "finish_reason")) or None

    def num(name: str) -> int:
        v = _first(result, name)
        return int(v) if v is not None else 0

    final = False
    with contextlib.suppress(Exception):
        params = result.get_response().parameters
        if "triton_final_response" in params:
            final = bool(params["triton_final_response"].bool_param)
    return TritonEvent(
        text=_as_str(_first(result, "text_output")),
        finish_reason=reason,
        prompt_tokens=num("prompt_tokens"),
        completion_tokens=num("completion_tokens"),
        steps=num("steps"),
        canvas=canvas,
        final=final,
    )


def _idle_error(idle_s: float) -> UpstreamTimeout:
    return UpstreamTimeout(f"Triton sent nothing for {idle_s:g} s", code="upstream_idle")


def _short(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, InferenceServerException):
        return exc.message() or str(exc)
    return str(exc) or type(exc).__name__


def _map_exception(exc: BaseException, retry_after_s: int) -> ProxyError:
    """gRPC status codes we can trust (connection level) first, then Triton's message."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return ServiceUnavailable(
                f"Triton is unavailable: {exc.details()}", retry_after_s, code="triton_unavailable"
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return UpstreamTimeout("Triton did not finish in time", code="timeout")
        if code == grpc.StatusCode.NOT_FOUND:
            return from_triton_message(exc.details() or "unknown model", retry_after_s)
        return from_triton_message(exc.details() or code.name, retry_after_s)
    if isinstance(exc, InferenceServerException):
        status = (exc.status() or "").upper()
        if "UNAVAILABLE" in status:
            return ServiceUnavailable(
                f"Triton is unavailable: {exc.message()}", retry_after_s, code="triton_unavailable"
            )
        return from_triton_message(exc.message() or str(exc), retry_after_s)
    return from_triton_message(str(exc), retry_after_s)
