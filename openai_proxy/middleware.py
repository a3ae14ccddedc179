"""Pure-ASGI middleware (streaming stays intact): request counting, the API-key gate and the body
size limit."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .error_handlers import error_response
from .errors import ProxyError, RequestTooLarge
from .metrics import ProxyMetrics
from .security import api_key_error


class RequestCounter:
    """Counts responses by route template and status."""

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


# Every route under this prefix is OpenAI's API and needs a key when keys are configured.
API_PREFIX = "/v1/"


class ApiKeyGate:
    """401 for an API call without a valid key, before its body is read: a caller without a
    key learns nothing from the proxy (not whether its JSON parses, nor the size limit), and
    the proxy reads nothing it sent. The routes' own `require_api_key` applies the same check."""

    def __init__(self, app: ASGIApp, keys: list[bytes]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys and scope["type"] == "http" and scope["path"].startswith(API_PREFIX):
            error = api_key_error(Headers(scope=scope), self.keys)
            if error is not None:
                await send_error(send, error)
                return
        await self.app(scope, receive, send)


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
                    await send_error(send, RequestTooLarge(self.limit))
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
                await send_error(send, RequestTooLarge(self.limit))

        await self.app(scope, limited_receive, guarded_send)


async def send_error(send: Send, err: ProxyError) -> None:
    """An OpenAI error answer sent straight on the ASGI channel (outside any route)."""
    response = error_response(err)
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": response.body})
