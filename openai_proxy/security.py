"""Safe exposure of the proxy: who may call it, and what an anonymous caller may learn.

- A proxy listening beyond loopback without API keys refuses to start, unless the operator
  says so (``--allow-no-auth``): an open generation endpoint on a public port is a mistake
  far more often than a choice.
- Keys come from flags/env (``DLM_PROXY_API_KEYS``) and from a file (``--api-keys-file``, one
  key per line, ``#`` comments): in compose a ``secrets:`` file, so keys never appear in
  ``docker inspect``.
- ``/health`` answers every caller with its status code and ``status``; the Triton URLs, model
  list and in-flight count are for callers with a valid key (or, with auth off, for a proxy
  that only listens on loopback).
- ``/metrics`` can move to its own port (``--metrics-port``, not published by compose) where
  it needs no key; it then leaves the API port. On the API port it needs a key when keys are
  configured (Prometheus sends one with ``authorization: credentials_file``).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .config import ProxyConfig
from .errors import AuthenticationError, error_body

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
METRICS_PATH = "/metrics"


class UnsafeExposureError(ValueError):
    """The settings would expose an unauthenticated API beyond this host."""


def is_loopback(host: str) -> bool:
    """True for addresses only this host can reach (``0.0.0.0`` and ``::`` are every address)."""
    host = host.strip().strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another host name: assume it resolves beyond loopback


def read_key_file(path: str | Path) -> list[str]:
    """Keys from a file: one per line; blank lines and ``#`` comments ignored."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"api_keys_file {str(file)!r} does not exist or is not a file")
    try:
        text = file.read_text()
    except OSError as exc:  # e.g. a secret file the proxy's user (uid 10001) may not read
        raise ValueError(f"cannot read api_keys_file {str(file)!r}: {exc.strerror}") from exc
    keys = []
    for line in text.splitlines():
        key = line.split("#", 1)[0].strip()
        if key:
            keys.append(key)
    return keys


def api_keys(cfg: ProxyConfig) -> list[bytes]:
    """Every accepted key: the configured list plus the key file's."""
    keys = list(cfg.api_keys)
    if cfg.api_keys_file:
        keys += read_key_file(cfg.api_keys_file)
    return [k.encode() for k in dict.fromkeys(keys)]


def check_exposure(cfg: ProxyConfig) -> None:
    """Refuse an API beyond loopback without keys (unless ``allow_no_auth``), and a metrics port
    that collides with the API port."""
    if cfg.metrics_port and cfg.metrics_port == cfg.port:
        raise UnsafeExposureError(f"metrics_port {cfg.metrics_port} is the API port: pick another")
    if api_keys(cfg) or cfg.allow_no_auth or is_loopback(cfg.host):
        return
    raise UnsafeExposureError(
        f"refusing to serve on {cfg.host}:{cfg.port} without API keys: anyone who reaches this "
        "port could generate. Give keys (--api-keys-file FILE or DLM_PROXY_API_KEYS_FILE, "
        "one per line; --api-key KEY), listen on 127.0.0.1, or pass --allow-no-auth "
        "(DLM_PROXY_ALLOW_NO_AUTH=1) if another layer authenticates"
    )


def bearer_ok(headers: Mapping[str, str] | list[tuple[bytes, bytes]], keys: list[bytes]) -> bool:
    """A valid ``Authorization: Bearer <key>`` (constant-time compare)."""
    if isinstance(headers, list):
        value = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), "")
    else:
        value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    given = token.strip().encode()
    return any(hmac.compare_digest(given, k) for k in keys)


def api_key_error(headers: Mapping[str, str], keys: list[bytes]) -> AuthenticationError | None:
    """Why this call may not use the API (None: no keys configured, or a valid bearer key)."""
    if not keys:
        return None
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
    if not bearer_ok(headers, keys):
        return AuthenticationError("invalid API key")
    return None


def sees_internals(headers: Mapping[str, str], cfg: ProxyConfig, keys: list[bytes]) -> bool:
    """May this caller see Triton URLs, models and load in /health?"""
    return bearer_ok(headers, keys) if keys else is_loopback(cfg.host)


def public_health(body: dict[str, Any]) -> dict[str, Any]:
    """What an anonymous caller gets: the status, nothing about the inside."""
    return {"status": body.get("status", "unavailable")}


class MetricsGate:
    """Pure ASGI: serve ``/metrics`` on the metrics port only (and nothing else there), or on the
    API port behind the API keys. The port is the connection's local port (``scope["server"]``),
    so one uvicorn server listens on both sockets with one lifespan and one drain."""

    def __init__(self, app: ASGIApp, cfg: ProxyConfig, keys: list[bytes]) -> None:
        self.app, self.metrics_port, self.keys = app, cfg.metrics_port, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_metrics = scope.get("path") == METRICS_PATH
        if self.metrics_port:
            on_metrics_port = (scope.get("server") or ("", None))[1] == self.metrics_port
            if is_metrics != on_metrics_port:
                await _reply(scope, receive, send, 404, "not found", "not_found_error")
                return
        elif is_metrics and self.keys and not bearer_ok(scope.get("headers", []), self.keys):
            await _reply(
                scope, receive, send, 401, "missing or invalid API key", "authentication_error"
            )
            return
        await self.app(scope, receive, send)


async def _reply(
    scope: Scope, receive: Receive, send: Send, status: int, msg: str, kind: str
) -> None:
    code = "invalid_api_key" if status == 401 else str(status)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    response = JSONResponse(error_body(msg, kind, code=code), status_code=status, headers=headers)
    await response(scope, receive, send)
