"""One generation call: its Triton jobs run, then answered as one JSON body or as SSE.

Shared by the chat and completions routers. A call counts as in flight (for the drain) from
its start until its last byte, and its Triton streams are cancelled whenever the client goes
away, before or during the response.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from .converters import (
    ChoiceResult,
    TritonJob,
    chat_response,
    check_admissible,
    completion_response,
    now,
    openai_finish_reason,
)
from .dependencies import ProxyState
from .errors import ProxyError, ServiceUnavailable
from .fan_in import FanIn
from .metrics import ProxyMetrics
from .schemas import ChatCompletionRequest, CompletionRequest
from .sse import ChunkBuilder, stream_events

T = TypeVar("T")


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


async def until_disconnect(request: Request, work: Awaitable[T], metrics: ProxyMetrics) -> T:
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


async def collect(fan: FanIn, jobs: list[TritonJob], retry_after_s: int) -> list[ChoiceResult]:
    """Every job's events folded into its choice; a non-OpenAI finish (abort) is a 503."""
    results = {j.choice_index: ChoiceResult(j.choice_index, j.prompt_index) for j in jobs}
    try:
        async for job, ev in fan:
            r = results[job.choice_index]
            r.absorb(ev)
            if ev.final:
                reason = openai_finish_reason(ev.finish_reason)
                if reason is None:
                    raise ServiceUnavailable(
                        f"generation ended by the server ({ev.finish_reason})", retry_after_s
                    )
                r.finish_reason = reason
    finally:
        fan.cancel()
    return list(results.values())


async def serve(
    request: Request,
    state: ProxyState,
    kind: str,
    body: ChatCompletionRequest | CompletionRequest,
    jobs: list[TritonJob],
    response_id: str,
) -> Any:
    """Run `jobs` for one call and answer it (kind: "chat" | "completion")."""
    backend, metrics, cfg = state.backend, state.metrics, state.config
    await backend.check_model(body.model)
    check_admissible(jobs, body.n, await backend.queue_capacity(body.model), body.model)
    created = now()
    metrics.begin()
    handed_off = False  # once a streaming response exists, its on_close ends the call
    try:
        fan = FanIn(backend, body.model, jobs)
        if not body.stream:
            try:
                results = await until_disconnect(
                    request, collect(fan, jobs, cfg.retry_after_s), metrics
                )
            finally:
                fan.cancel()
            metrics.count_tokens(results)
            build = chat_response if kind == "chat" else completion_response
            return JSONResponse(build(response_id, created, body.model, results))
        try:
            await until_disconnect(request, fan.raise_early_error(cfg.first_event_wait_s), metrics)
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
