"""The FastAPI application: routes, auth, limits, error mapping and graceful drain.

`create_app(config)` builds a fresh app (tests start several with different settings).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import __name__ as _pkg
from .config import ProxyConfig
from .converters import (
    ChoiceResult,
    TritonJob,
    chat_jobs,
    chat_response,
    completion_jobs,
    completion_response,
    new_id,
    now,
    openai_finish_reason,
)
from .errors import (
    AuthenticationError,
    InternalError,
    InvalidRequest,
    ProxyError,
    RequestTooLarge,
    ServiceUnavailable,
    error_body,
)
from .schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from .sse import ChunkBuilder, stream_events
from .triton_backend import FanIn, TritonBackend

log = logging.getLogger(_pkg)
T = TypeVar("T")

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)
}


class ProxyMetrics:
    """Proxy-side counters in Prometheus text format (Triton's own are on its metrics port)."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.in_flight = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.disconnects = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def end(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except (TimeoutError, asyncio.TimeoutError):
            return False

    def count_tokens(self, results: list[ChoiceResult]) -> None:
        seen: dict[int, int] = {}
        for r in results:
            seen[r.prompt_index] = max(seen.get(r.prompt_index, 0), r.prompt_tokens)
            self.completion_tokens += r.completion_tokens
        self.prompt_tokens += sum(seen.values())

    def render(self, backend: TritonBackend, triton_metrics_url: str) -> str:
        lines = [
            f"# Triton and model metrics (nv_*, dlm_*): {triton_metrics_url}",
            "# HELP dlm_proxy_requests_total HTTP requests by route and status.",
            "# TYPE dlm_proxy_requests_total counter",
        ]
        for (route, status), count in sorted(self.requests.items()):
            lines.append(f'dlm_proxy_requests_total{{route="{route}",status="{status}"}} {count}')
        gauges = {
            "dlm_proxy_in_flight_requests": ("Requests being served now.", self.in_flight),
            "dlm_proxy_triton_ready": (
                "Triton URLs that answered ready at the last probe.",
                sum(1 for h in backend.health() if h["ready"]),
            ),
        }
        counters = {
            "dlm_proxy_prompt_tokens_total": (
                "Prompt tokens of finished calls.",
                self.prompt_tokens,
            ),
            "dlm_proxy_completion_tokens_total": (
                "Completion tokens of finished calls.",
                self.completion_tokens,
            ),
            "dlm_proxy_client_disconnects_total": (
                "Calls whose client went away before the end.",
                self.disconnects,
            ),
            "dlm_proxy_triton_streams_total": ("Triton streams opened.", backend.streams_opened),
            "dlm_proxy_triton_streams_cancelled_total": (
                "Triton streams cancelled before their final response.",
                backend.streams_cancelled,
            ),
        }
        for name, (help_text, value) in gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
        for name, (help_text, value) in counters.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        return "\n".join(lines) + "\n"


class RequestCounter:
    """Counts responses by route template and status (pure ASGI: keeps streaming intact)."""

    def __init__(self, app: ASGIApp, metrics: ProxyMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            route = getattr(scope.get("route"), "path", "other")
            self.metrics.requests[(route, status or 499)] += 1


class BodySizeLimit:
    """413 for bodies over the limit, by Content-Length or while reading a chunked body."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.limit
                except ValueError:
                    too_big = False
                if too_big:
                    await _send_error(send, RequestTooLarge(self.limit))
                    return
        received = 0
        too_big = False
        answered = False

        async def limited_receive() -> Message:
            # Past the limit the body is cut short; whatever the app answers to the stump is
            # replaced by the 413 below (FastAPI would turn a raised error into a vague 400).
            nonlocal received, too_big
            if too_big:
                return {"type": "http.request", "body": b"", "more_body": False}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    too_big = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal answered
            if not too_big:
                await send(message)
            elif message["type"] == "http.response.start" and not answered:
                answered = True
                await _send_error(send, RequestTooLarge(self.limit))

        await self.app(scope, limited_receive, guarded_send)


async def _send_error(send: Send, err: ProxyError) -> None:
    response = error_response(err)
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": response.body})


def error_response(err: ProxyError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status_code, headers=err.headers or None)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """First pydantic error as 'field: message', with the field path as OpenAI's `param`."""
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
    param = ".".join(loc) if loc else None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


class CleanupStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close`, even if the body was never iterated.

    Starlette cancels the body iterator when the client disconnects; if that happens before the
    iterator started, its `finally` never runs. This hook still cancels the Triton streams.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _until_disconnect(request: Request, work: Awaitable[T], metrics: ProxyMetrics) -> T:
    """Run `work` but cancel it as soon as the HTTP client goes away.

    Non-streaming calls need this: nothing else notices a vanished client, and the Triton rows
    would keep generating for nobody.
    """
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            if watcher.done():
                metrics.disconnects += 1
        watcher.cancel()
    if not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # 499 is nginx's "client closed request"; nobody reads it, but logs and metrics do.
        raise ProxyError("client disconnected", status_code=499, error_type="client_closed")
    return task.result()


def create_app(config: ProxyConfig | None = None) -> FastAPI:
    """Build the proxy app; Triton clients are created in the lifespan (inside the event loop)."""
    cfg = config or ProxyConfig()
    cfg.validate()
    backend = TritonBackend(cfg)
    metrics = ProxyMetrics()
    state: dict[str, Any] = {"draining": False}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        log.info("proxy ready; triton %s", ", ".join(cfg.triton_urls))
        try:
            yield
        finally:
            # New calls get 503; running ones may finish within the drain timeout.
            state["draining"] = True
            if metrics.in_flight:
                log.info("draining %d in-flight requests", metrics.in_flight)
                if not await metrics.wait_idle(cfg.drain_timeout_s):
                    log.warning("drain timeout: %d requests still running", metrics.in_flight)
            await backend.close()

    app = FastAPI(
        title="dlm-triton OpenAI-compatible API",
        version="0.1.0",
        description="OpenAI chat and completions for diffusion language models (LLaDA, Dream) "
        "served by Triton. Diffusion fields (steps, block_length, algorithm, threshold, "
        "alg_temp, cfg_scale, stream_mode) extend the OpenAI request bodies.",
        lifespan=lifespan,
    )
    app.state.config = cfg
    app.state.backend = backend
    app.state.metrics = metrics

    # -- errors: always OpenAI's JSON, never a traceback ----------------------------------------

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(InvalidRequest(message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), kind, code=str(exc.status_code))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return error_response(InternalError("internal error in the proxy; see its log"))

    # -- middleware -----------------------------------------------------------------------------

    if cfg.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cfg.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    app.add_middleware(BodySizeLimit, limit=cfg.max_request_bytes)
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: counts 413s too

    # -- dependencies ---------------------------------------------------------------------------

    keys = [k.encode() for k in cfg.api_keys]

    async def require_key(request: Request) -> None:
        """Bearer auth, only when keys are configured (constant-time compare)."""
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        given = token.strip().encode()
        if not any(hmac.compare_digest(given, k) for k in keys):
            raise AuthenticationError("invalid API key")

    def not_draining() -> None:
        if state["draining"]:
            raise ServiceUnavailable("proxy is shutting down", cfg.retry_after_s, code="draining")

    guards = [Depends(require_key), Depends(not_draining)]

    # -- generation -----------------------------------------------------------------------------

    async def collect(fan: FanIn, jobs: list[TritonJob]) -> list[ChoiceResult]:
        results = {j.choice_index: ChoiceResult(j.choice_index, j.prompt_index) for j in jobs}
        try:
            async for job, ev in fan:
                r = results[job.choice_index]
                r.text += ev.text
                r.prompt_tokens = ev.prompt_tokens or r.prompt_tokens
                r.completion_tokens = ev.completion_tokens or r.completion_tokens
                if ev.final:
                    reason = openai_finish_reason(ev.finish_reason)
                    if reason is None:
                        raise ServiceUnavailable(
                            f"generation ended by the server ({ev.finish_reason})",
                            cfg.retry_after_s,
                        )
                    r.finish_reason = reason
        finally:
            fan.cancel()
        return list(results.values())

    async def serve(
        request: Request,
        kind: str,
        body: ChatCompletionRequest | CompletionRequest,
        jobs: list[TritonJob],
        response_id: str,
    ) -> Any:
        await backend.check_model(body.model)
        created = now()
        metrics.begin()
        handed_off = False  # once a streaming response exists, its on_close ends the call
        try:
            fan = FanIn(backend, body.model, jobs)
            if not body.stream:
                try:
                    results = await _until_disconnect(request, collect(fan, jobs), metrics)
                finally:
                    fan.cancel()
                metrics.count_tokens(results)
                build = chat_response if kind == "chat" else completion_response
                return JSONResponse(build(response_id, created, body.model, results))
            try:
                await _until_disconnect(
                    request, fan.raise_early_error(cfg.first_event_wait_s), metrics
                )
            except BaseException:
                fan.cancel()
                raise
            builder = ChunkBuilder(kind, response_id, created, body.model, body.include_usage())

            async def body_iter() -> AsyncIterator[bytes]:
                finished = False
                try:
                    async for data in stream_events(builder, jobs, fan, metrics.count_tokens):
                        yield data
                    finished = True
                finally:
                    fan.cancel()
                    if not finished:
                        metrics.disconnects += 1

            def on_close() -> None:
                fan.cancel()
                metrics.end()

            response = CleanupStreamingResponse(body_iter(), on_close)
            handed_off = True
            return response
        finally:
            if not handed_off:
                metrics.end()

    # -- routes ---------------------------------------------------------------------------------

    @app.post(
        "/v1/chat/completions",
        dependencies=guards,
        response_model=ChatCompletionResponse,
        responses=_ERROR_RESPONSES,
        summary="Chat completion (stream=true: SSE chunks)",
    )
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Any:
        response_id = new_id("chatcmpl")
        jobs = chat_jobs(body, response_id, cfg)
        return await serve(request, "chat", body, jobs, response_id)

    @app.post(
        "/v1/completions",
        dependencies=guards,
        response_model=CompletionResponse,
        responses=_ERROR_RESPONSES,
        summary="Text completion of raw prompts or token ids (stream=true: SSE chunks)",
    )
    async def completions(request: Request, body: CompletionRequest) -> Any:
        response_id = new_id("cmpl")
        jobs = completion_jobs(body, response_id, cfg)
        return await serve(request, "completion", body, jobs, response_id)

    @app.get("/v1/models", dependencies=[Depends(require_key)], response_model=ModelList)
    async def list_models() -> Any:
        if not backend.any_ready():
            await backend.refresh()
            if not backend.any_ready():
                raise backend._unavailable()
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": created, "owned_by": "dlm-triton"}
                for m in backend.ready_models()
            ],
        }

    @app.get("/v1/models/{model_id}", dependencies=[Depends(require_key)])
    async def get_model(model_id: str) -> Any:
        await backend.check_model(model_id)
        return {
            "id": model_id,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "dlm-triton",
        }

    @app.get("/health", summary="Proxy and Triton readiness (503 while no Triton is ready)")
    async def health() -> Any:
        if not backend.any_ready():
            await backend.refresh()
        ready = backend.any_ready() and not state["draining"]
        body = {
            "status": "ok" if ready else ("draining" if state["draining"] else "unavailable"),
            "triton": backend.health(),
            "models": backend.ready_models(),
            "in_flight": metrics.in_flight,
        }
        if ready:
            return body
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(cfg.retry_after_s)})

    @app.get("/health/live", summary="The proxy process answers (no Triton check)")
    async def live() -> Any:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, summary="Proxy metrics (Prometheus)")
    async def prom_metrics() -> Any:
        return PlainTextResponse(
            metrics.render(backend, cfg.triton_metrics_url),
            media_type="text/plain; version=0.0.4",
        )

    # for openai_proxy.drain: 503 `draining` to new calls while the listener stays open
    app.state.begin_drain = lambda: state.update(draining=True)
    app.state.in_flight = lambda: metrics.in_flight
    return app
