"""Safe exposure of the proxy: who may call it, and what a caller may learn of others.

- A proxy listening beyond loopback without API keys refuses to start, unless the operator
  says so (``--allow-no-auth``): an open generation endpoint on a public port is a mistake
  far more often than a choice.
- Keys come from flags/env (``DLM_PROXY_API_KEYS``) and from a file (``--api-keys-file``, one
  key per line, ``#`` comments): in compose a ``secrets:`` file, so keys never appear in
  ``docker inspect``.
- API keys are tenants: one must learn nothing of another's requests. Everything that counts
  all requests (``/metrics``: prompt and completion tokens, requests, load; ``/health``'s
  in-flight count, Triton URLs and models) is for operators: admin keys (``--admin-keys-file``),
  or a private metrics port. Cached prompt pages are kept per key (``tenancy.py``).
- ``/health`` answers every caller with its status code and ``status`` (load balancers need no
  key); its details are for an admin key (with no key configured at all: for a proxy that
  only listens on loopback).
- ``/metrics`` can move to its own port (``--metrics-port``, not published by compose) where
  it needs no key; it then leaves the API port. On the API port it needs an admin key once any
  key is configured (Prometheus sends one with ``authorization: credentials_file``).
- The API's schema (``/openapi.json``) needs a key like ``/v1/``; no browser UI is served
  (``/docs`` and ``/redoc`` would load Swagger UI and ReDoc from a CDN onto this origin).
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


def admin_keys(cfg: ProxyConfig) -> list[bytes]:
    """Every operator key: the configured list plus the admin key file's."""
    keys = list(cfg.admin_keys)
    if cfg.admin_keys_file:
        keys += read_key_file(cfg.admin_keys_file)
    return [k.encode() for k in dict.fromkeys(keys)]


def check_exposure(cfg: ProxyConfig) -> None:
    """Refuse an API beyond loopback without keys (unless ``allow_no_auth``), and a metrics port
    that collides with the API port."""
    if cfg.metrics_port and cfg.metrics_port == cfg.port:
        raise UnsafeExposureError(f"metrics_port {cfg.metrics_port} is the API port: pick another")
    admin_keys(cfg)  # an admin key file that cannot be read stops the start, not a request
    if api_keys(cfg) or cfg.allow_no_auth or is_loopback(cfg.host):
        return
    raise UnsafeExposureError(
        f"refusing to serve on {cfg.host}:{cfg.port} without API keys: anyone who reaches this "
        "port could generate. Give keys (--api-keys-file FILE or DLM_PROXY_API_KEYS_FILE, "
        "one per line; --api-key KEY), listen on 127.0.0.1, or pass --allow-no-auth "
        "(DLM_PROXY_ALLOW_NO_AUTH=1) if another layer authenticates"
    )


Headers = Mapping[str, str] | list[tuple[bytes, bytes]]


def matching_key(headers: Headers, keys: list[bytes]) -> bytes | None:
    """The key of a valid ``Authorization: Bearer <key>``, None without one (every key is
    compared, each in constant time)."""
    if isinstance(headers, list):
        value = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), "")
    else:
        value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    given = token.strip().encode()
    found = None
    for key in keys:
        if hmac.compare_digest(given, key):
            found = key
    return found


def bearer_ok(headers: Headers, keys: list[bytes]) -> bool:
    """A valid ``Authorization: Bearer <key>`` (constant-time compare)."""
    return matching_key(headers, keys) is not None


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


def sees_internals(
    headers: Mapping[str, str], cfg: ProxyConfig, keys: list[bytes], admins: list[bytes]
) -> bool:
    """May this caller see Triton URLs, models and everyone's load in /health? An operator
    (admin key); with no key configured at all, anyone who can reach a loopback-only proxy."""
    if keys or admins:
        return bearer_ok(headers, admins)
    return is_loopback(cfg.host)


def public_health(body: dict[str, Any]) -> dict[str, Any]:
    """What an anonymous caller gets: the status, nothing about the inside."""
    return {"status": body.get("status", "unavailable")}


class MetricsGate:
    """Pure ASGI: serve ``/metrics`` on the metrics port only (and nothing else there), or on the
    API port for admin keys once any key is configured. The port is the connection's local port
    (``scope["server"]``), so one uvicorn server listens on both sockets with one lifespan and
    one drain."""

    def __init__(
        self, app: ASGIApp, cfg: ProxyConfig, keys: list[bytes], admins: list[bytes]
    ) -> None:
        self.app, self.metrics_port, self.keys, self.admins = app, cfg.metrics_port, keys, admins

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
        elif is_metrics and (self.keys or self.admins):
            headers = scope.get("headers", [])
            if not bearer_ok(headers, self.admins):
                if bearer_ok(headers, self.keys):  # a tenant: these count everyone's requests
                    msg = "/metrics needs an admin key (--admin-keys-file) or the --metrics-port"
                    await _reply(scope, receive, send, 403, msg, "permission_error")
                else:
                    msg = "missing or invalid admin key"
                    await _reply(scope, receive, send, 401, msg, "authentication_error")
                return
        await self.app(scope, receive, send)


async def _reply(
    scope: Scope, receive: Receive, send: Send, status: int, msg: str, kind: str
) -> None:
    code = {401: "invalid_api_key", 403: "admin_key_required"}.get(status, str(status))
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    response = JSONResponse(error_body(msg, kind, code=code), status_code=status, headers=headers)
    await response(scope, receive, send)
